"""Checking what `--preset_lora_path` merged (the differential-LoRA scripts): the preset model's weights before and
after the merge, recorded during the run, against the preset file's own update read straight from it."""

from __future__ import annotations

import re

import torch
from safetensors.torch import load_file

_KEY = re.compile(r"^(?:diffusion_model\.|transformer\.|pipe\.dit\.)?(.+)\.lora_(A|B|down|up)(?:\.default)?\.weight$")


def record_merges(monkeypatch) -> list[tuple[dict, dict]]:
    """(weights before, weights after) of every model a preset LoRA is merged into during the run."""
    import difftune.lora as lora

    merges, real = [], lora.fuse_lora

    def fuse(module, imported, *args, **kwargs):
        before = {k: v.detach().clone() for k, v in module.state_dict().items()}
        out = real(module, imported, *args, **kwargs)
        merges.append((before, {k: v.detach().clone() for k, v in module.state_dict().items()}))
        return out

    monkeypatch.setattr(lora, "fuse_lora", fuse)
    return merges


def preset_updates(path) -> dict[str, torch.Tensor]:
    """{module path: alpha / rank * B @ A} of a LoRA file, from its tensors (layout prefixes dropped)."""
    state = load_file(str(path))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in state.items():
        m = _KEY.match(key)
        if m:
            pairs.setdefault(m[1], {})["A" if m[2] in ("A", "down") else "B"] = tensor.float()
    updates = {}
    for module, ab in pairs.items():
        alpha = next((state[k].item() for k in (f"{module}.alpha", f"diffusion_model.{module}.alpha") if k in state),
                     ab["A"].shape[0])
        updates[module] = ab["B"] @ ab["A"] * (alpha / ab["A"].shape[0])
    return updates


def check_merge(merges, path) -> int:
    """The run merged the preset file once: each of its modules' weights moved by exactly its update (as the merge
    rounds it into the weight's dtype), and nothing else moved. Returns the modules checked."""
    assert len(merges) == 1, f"{len(merges)} preset merges"
    (before, after), updates = merges[0], preset_updates(path)
    assert updates, f"{path}: no LoRA pairs"
    for module, update in updates.items():
        key = f"{module}.weight"
        assert key in before, f"{key}: no such weight in the preset model"
        expected = (before[key].float() + update).to(before[key].dtype)
        torch.testing.assert_close(after[key], expected, rtol=1e-5, atol=1e-6)
    moved = {k for k in before if not torch.equal(before[k], after[k])}
    assert moved <= {f"{m}.weight" for m in updates}, sorted(moved - {f"{m}.weight" for m in updates})[:3]
    return len(moved)  # an update below the weight dtype's step leaves it as it was
