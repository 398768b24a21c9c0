"""A tiny workspace where both SDXL scripts of the reference run with only their script path changed:
`./models/stabilityai/stable-diffusion-xl-base-1.0/` and `./data/diffsynth_example_dataset/stable_diffusion_xl/
stable-diffusion-xl-base-1.0/` (images and prompts; the pictures larger than the training size and of another
aspect, so the time ids carry a real original size and crop). The UNet has SDXL's blocks (every module the LoRA
script names)."""

from __future__ import annotations

import os
from pathlib import Path

from ..common import write_example_dataset
from .tiny import TinySDXLSpec, write_tiny_sdxl_hub

DATA = Path("data") / "diffsynth_example_dataset" / "stable_diffusion_xl" / "stable-diffusion-xl-base-1.0"


def write_sdxl_script_workspace(root: str | os.PathLike) -> Path:
    root = Path(root)
    write_tiny_sdxl_hub(root / "models", TinySDXLSpec(sdxl_blocks=True))
    (root / DATA).mkdir(parents=True, exist_ok=True)
    write_example_dataset(root / DATA, n=2, size=(48, 40))
    return root
