"""A tiny workspace where the reference's four Krea-2 scripts run with only their script path changed:
`./models/<hub id>/` for every repository they name (hub ids resolve there without a download) and
`./data/diffsynth_example_dataset/krea2/Krea-2-{Raw,Turbo}/` with a two-image data set each."""

from __future__ import annotations

import os
from pathlib import Path

from ..common import write_example_dataset
from .tiny import write_tiny_krea2_hub

DATA = Path("data") / "diffsynth_example_dataset" / "krea2"


def write_krea2_script_workspace(root: str | os.PathLike) -> Path:
    root = Path(root)
    write_tiny_krea2_hub(root / "models")
    for name in ("Krea-2-Raw", "Krea-2-Turbo"):
        folder = root / DATA / name
        folder.mkdir(parents=True, exist_ok=True)
        write_example_dataset(folder, n=2, size=(32, 32))
    return root
