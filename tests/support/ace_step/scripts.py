"""A tiny workspace where the reference's ACE-Step scripts run with only their script path changed:
`./models/ACE-Step/Ace-Step1.5/` (turbo's single file, its silence latent, Qwen3-Embedding, the VAE), the other
DiTs at their own repositories (`ACE-Step/acestep-v15-{base,sft,turbo-*}:model.safetensors`, the XL ones as
`model-*.safetensors` shards), and each script's data folder under `./data/diffsynth_example_dataset/ace_step/`."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from .tiny import DIT_FILE, write_ace_step_dataset, write_tiny_ace_step_hub

SINGLE = ("base", "sft", "turbo-continuous", "turbo-shift1", "turbo-shift3")
XL = ("xl-base", "xl-sft", "xl-turbo")
DATA = Path("data") / "diffsynth_example_dataset" / "ace_step"
DATASETS = ("Ace-Step1.5", *(f"acestep-v15-{v}" for v in SINGLE + XL), "acestep15xlsft-vocals2music")


def _shards(src: Path, folder: Path) -> None:
    """The single file as the XL releases ship theirs: two shards and their index."""
    from safetensors.torch import load_file, save_file

    state = load_file(str(src))
    keys = sorted(state)
    parts = (keys[: len(keys) // 2], keys[len(keys) // 2:])
    folder.mkdir(parents=True, exist_ok=True)
    index = {}
    for i, part in enumerate(parts, 1):
        name = f"model-{i:05d}-of-00002.safetensors"
        save_file({k: state[k] for k in part}, str(folder / name))
        index.update({k: name for k in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))


def write_ace_step_script_workspace(root: str | os.PathLike) -> Path:
    root = Path(root)
    repo = write_tiny_ace_step_hub(root / "models")
    for variant in SINGLE:
        folder = root / "models" / "ACE-Step" / f"acestep-v15-{variant}"
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(repo / DIT_FILE, folder / "model.safetensors")
    for variant in XL:
        _shards(repo / DIT_FILE, root / "models" / "ACE-Step" / f"acestep-v15-{variant}")
    for name in DATASETS:
        write_ace_step_dataset(root / DATA / name)
    return root


__all__ = ["write_ace_step_script_workspace"]
