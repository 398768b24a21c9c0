"""The reference's EliGen, In-Context and Blockwise ControlNet training scripts (tests/reference_scripts, DiffSynth-Studio
fed7b18) run with `accelerate launch .../train.py` replaced by `difftune train` and `--max_steps 2`, on tiny models
and data laid out where the scripts look for them."""

from __future__ import annotations

import shlex
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import run_train
from difftune.testing import (TinyQwenImageSpec, tiny_qwen_transformer, write_control_dataset,
                              write_tiny_blockwise_controlnet, write_tiny_qwen_image)

SCRIPTS = Path(__file__).parents[1] / "reference_scripts" / "qwen_image" / "model_training"
CASES = {  # script -> (data kind, the LoRA it continues from, if any)
    "lora/Qwen-Image-EliGen.sh": ("eligen", None),
    "lora/Qwen-Image-EliGen-Poster.sh": ("eligen", "DiffSynth-Studio/Qwen-Image-EliGen-V2"),
    "lora/Qwen-Image-In-Context-Control-Union.sh": ("context", "DiffSynth-Studio/Qwen-Image-In-Context-Control-Union"),
    **{f"{mode}/Qwen-Image-Blockwise-ControlNet-{v}.sh": ("inpaint" if v == "Inpaint" else "controlnet", None)
       for mode in ("lora", "full") for v in ("Canny", "Depth", "Inpaint")},
}


def script_args(path: Path) -> list[str]:
    """The arguments the script gives train.py (its first `accelerate launch` command)."""
    text = path.read_text().replace("\\\n", " ")
    line = next(l for l in text.splitlines() if l.startswith("accelerate launch"))
    words = shlex.split(line)
    return words[next(i for i, w in enumerate(words) if w.endswith("train.py")) + 1:]


def reference_lora(path: Path, rank: int, targets: str) -> None:
    """A LoRA for the tiny DiT in the layout the reference saves (`<module>.lora_A.default.weight`, no prefix)."""
    dit = tiny_qwen_transformer(TinyQwenImageSpec())
    names = targets.split(",")
    torch.manual_seed(0)
    state = {}
    for name, module in dit.named_modules():
        if isinstance(module, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in names):
            state[f"{name}.lora_A.default.weight"] = torch.randn(rank, module.in_features) * 0.01
            state[f"{name}.lora_B.default.weight"] = torch.randn(module.out_features, rank) * 0.01
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_control_scripts")
    write_tiny_qwen_image(root / "models" / "Qwen" / "Qwen-Image")
    for v in ("Canny", "Depth", "Inpaint"):
        write_tiny_blockwise_controlnet(root / "models" / "DiffSynth-Studio" / f"Qwen-Image-Blockwise-ControlNet-{v}",
                                        inpaint=v == "Inpaint")
    return root


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(CASES))
def test_reference_script_runs(workspace, script, monkeypatch):
    kind, lora = CASES[script]
    args = script_args(SCRIPTS / script)
    data = Path(args[args.index("--dataset_base_path") + 1])
    meta = Path(args[args.index("--dataset_metadata_path") + 1])
    monkeypatch.chdir(workspace)
    if not meta.exists():
        written = write_control_dataset(data, kind, size=(48, 32))
        assert written.name == meta.name  # the layout the script expects (metadata.json for EliGen)
    if lora is not None:
        checkpoint = Path(args[args.index("--lora_checkpoint") + 1])
        reference_lora(checkpoint, int(args[args.index("--lora_rank") + 1]),
                       args[args.index("--lora_target_modules") + 1])
    out = Path(args[args.index("--output_path") + 1])
    summary = run_train(*args, "--max_steps", 2, "--no_progress")
    assert summary["steps"] == 2
    saved = sorted(out.glob("*.safetensors"))
    assert saved
    state = load_file(str(saved[-1]))
    if script.startswith("full/"):  # the released ControlNet layout
        released = load_file(str(workspace / "models" / "DiffSynth-Studio" / Path(script).stem / "model.safetensors"))
        assert state.keys() == released.keys()
    else:
        assert state and all(k.startswith("transformer.") for k in state)
