"""A tiny workspace where the reference's ACE-Step scripts run with only their script path changed:
`./models/ACE-Step/Ace-Step1.5/` (turbo's single file, its silence latent, Qwen3-Embedding, the VAE), the other
DiTs at their own repositories (`ACE-Step/acestep-v15-{base,sft,turbo-*}:model.safetensors` with its config.json;
the XL ones wider, as `model-*.safetensors` shards, with no silence latent: their scripts name turbo's), and each
script's data folder under `./data/diffsynth_example_dataset/ace_step/`."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from .tiny import DIT_FILE, write_ace_step_dataset, write_tiny_ace_step_hub, write_tiny_ace_step_xl

SINGLE = ("base", "sft", "turbo-continuous", "turbo-shift1", "turbo-shift3")
XL = ("xl-base", "xl-sft", "xl-turbo")
DATA = Path("data") / "diffsynth_example_dataset" / "ace_step"
DATASETS = ("Ace-Step1.5", *(f"acestep-v15-{v}" for v in SINGLE + XL), "acestep15xlsft-vocals2music")


def write_ace_step_script_workspace(root: str | os.PathLike) -> Path:
    root = Path(root)
    repo = write_tiny_ace_step_hub(root / "models")
    for variant in SINGLE:
        folder = root / "models" / "ACE-Step" / f"acestep-v15-{variant}"
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy(repo / DIT_FILE, folder / "model.safetensors")
        shutil.copy((repo / DIT_FILE).with_name("config.json"), folder / "config.json")
    for i, variant in enumerate(XL):  # each XL model its own random DiT
        write_tiny_ace_step_xl(root / "models" / "ACE-Step" / f"acestep-v15-{variant}", seed=1 + i)
    for name in DATASETS:
        write_ace_step_dataset(root / DATA / name)
    return root


__all__ = ["write_ace_step_script_workspace"]
