"""A tiny workspace where both Stable Diffusion 1.5 scripts of the reference run with only their script path changed:
`./models/AI-ModelScope/stable-diffusion-v1-5/` (the hub id resolves there without a download; its UNet wide enough
for the reference's automatic LoRA targets) and `./data/diffsynth_example_dataset/stable_diffusion/
stable-diffusion-v1-5/` (images and prompts)."""

from __future__ import annotations

import os
from pathlib import Path

from ..common import write_example_dataset
from .tiny import TinySDSpec, write_tiny_sd_hub

DATA = Path("data") / "diffsynth_example_dataset" / "stable_diffusion" / "stable-diffusion-v1-5"


def write_sd_script_workspace(root: str | os.PathLike) -> Path:
    root = Path(root)
    write_tiny_sd_hub(root / "models", TinySDSpec(wide=True))
    (root / DATA).mkdir(parents=True, exist_ok=True)
    write_example_dataset(root / DATA, n=2, size=(32, 32))
    return root
