"""A tiny workspace where both ERNIE-Image scripts of the reference run with only their script path changed:
`./models/PaddlePaddle/ERNIE-Image/` (the hub id resolves there without a download) and
`./data/diffsynth_example_dataset/ernie_image/Ernie-Image-T2I/` (images and prompts)."""

from __future__ import annotations

import os
from pathlib import Path

from ..common import write_example_dataset
from .tiny import write_tiny_ernie_image_hub

DATA = Path("data") / "diffsynth_example_dataset" / "ernie_image" / "Ernie-Image-T2I"


def write_ernie_image_script_workspace(root: str | os.PathLike) -> Path:
    root = Path(root)
    write_tiny_ernie_image_hub(root / "models")
    (root / DATA).mkdir(parents=True, exist_ok=True)
    write_example_dataset(root / DATA, n=2, size=(32, 32))
    return root
