"""A tiny workspace where both Anima scripts of the reference run with only their script path changed:
`./models/<hub id>/` for every repository they name (hub ids resolve there without a download) and
`./data/diffsynth_example_dataset/anima/anima-preview/` (images and prompts)."""

from __future__ import annotations

import os
from pathlib import Path

from ..common import write_example_dataset
from .tiny import write_tiny_anima_hub

DATA = Path("data") / "diffsynth_example_dataset" / "anima" / "anima-preview"


def write_anima_script_workspace(root: str | os.PathLike) -> Path:
    root = Path(root)
    write_tiny_anima_hub(root / "models")
    (root / DATA).mkdir(parents=True, exist_ok=True)
    write_example_dataset(root / DATA, n=2, size=(32, 32))
    return root
