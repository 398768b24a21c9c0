"""A tiny workspace where the reference's Ideogram-4 scripts run with only their script path changed: `./models/<hub
id>/` for the three repositories they name (the bf16 repackage, ideogram-ai's fp8 and nf4 releases, pre-quantised as
those ship: fp8 weights with a per-row `weight_scale`, bitsandbytes NF4 saves, both in Ideogram's original names with
the fused qkv), the tokenizer the reference defaults to, and `./data/diffsynth_example_dataset/ideogram4/<name>/`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..common import write_example_dataset
from .tiny import REPACKAGE, TOKENIZER_REPO, _save, tiny_dit, tiny_text_encoder, tiny_vae, write_tiny_ideogram4_hub

DATA = Path("data") / "diffsynth_example_dataset" / "ideogram4"
RELEASES = {"fp8": "ideogram-ai/ideogram-4-fp8", "nf4": "ideogram-ai/ideogram-4-nf4"}


def _quantised_linears(state: dict, linears: set[str], how: str) -> dict:
    """`state` with the weights of the Linear layers `linears` stored as Ideogram's releases store them."""
    out = {k: v for k, v in state.items() if k[: -len(".weight")] not in linears or not k.endswith(".weight")}
    for name in sorted(linears):
        w = state[f"{name}.weight"].float()
        if how == "fp8":
            scale = w.abs().amax(dim=1).clamp(min=1e-8) / 448
            out[f"{name}.weight"] = (w / scale[:, None]).to(torch.float8_e4m3fn)
            out[f"{name}.weight_scale"] = scale
        else:
            import bitsandbytes as bnb

            layer = bnb.nn.Linear4bit(w.shape[1], w.shape[0], bias=False, compute_dtype=torch.float32,
                                      quant_type="nf4", compress_statistics=False)
            layer.weight = bnb.nn.Params4bit(w.clone(), requires_grad=False, quant_type="nf4",
                                             compress_statistics=False)
            layer = layer.to("cpu")
            for k, v in layer.state_dict().items():
                out[f"{name}.{k}"] = v.detach().clone().contiguous()
    return out


def _linear_names(state: dict, prefix: str) -> set[str]:
    return {k[: -len(".weight")] for k, v in state.items()
            if k.startswith(prefix) and k.endswith(".weight") and v.dim() == 2 and "norm" not in k
            and "embed" not in k}


def write_release(base: Path, how: str) -> Path:
    """ideogram-ai/ideogram-4-<how>: the DiT's and the text encoder's block Linears quantised, the VAE as is."""
    from difftune.families.ideogram4.components import original_dit_keys

    repo = base / RELEASES[how]
    for folder, seed in (("transformer", 0), ("unconditional_transformer", 1)):
        dit = original_dit_keys(tiny_dit(seed=seed).state_dict())
        _save(_quantised_linears(dit, _linear_names(dit, "layers."), how),
              repo / folder / "diffusion_pytorch_model.safetensors")
    text = tiny_text_encoder().state_dict()
    _save(_quantised_linears(text, _linear_names(text, "language_model.layers."), how),
          repo / "text_encoder" / "model.safetensors")
    _save(tiny_vae().state_dict(), repo / "vae" / "diffusion_pytorch_model.safetensors")
    return repo


def write_ideogram4_script_workspace(root: str | os.PathLike, releases: bool = True) -> Path:
    root = Path(root)
    write_tiny_ideogram4_hub(root / "models")
    if releases:
        for how in RELEASES:
            write_release(root / "models", how)
    for name in ("Ideogram-4-bf16-repackage", "Ideogram-4-fp8", "Ideogram-4-nf4"):
        folder = root / DATA / name
        folder.mkdir(parents=True, exist_ok=True)
        csv = write_example_dataset(folder, n=2, size=(32, 32))
        rows = [line.split(",", 1) for line in Path(csv).read_text().splitlines()[1:]]
        (folder / "metadata.json").write_text(json.dumps([{"image": i, "prompt": p} for i, p in rows]))
    return root


__all__ = ["RELEASES", "write_ideogram4_script_workspace", "write_release"]
