"""A tiny workspace where the reference's FLUX.2 scripts run with only their script path changed: `./models/<hub id>/`
for every repository they name (hub ids resolve there without a download) and the data sets where they look
(`./data/diffsynth_example_dataset/flux2/<name>/`, and `./data/example_image_dataset/` for the split-training
script's first command)."""

from __future__ import annotations

import os
from pathlib import Path

from ..common import write_example_dataset
from .tiny import write_tiny_flux2_hub

DATA = Path("data") / "diffsynth_example_dataset" / "flux2"
DATASETS = ("FLUX.2-dev", "FLUX.2-klein-4B", "FLUX.2-klein-9B", "FLUX.2-klein-base-4B", "FLUX.2-klein-base-9B")


def write_flux2_script_workspace(root: str | os.PathLike, *, dev: bool = True) -> Path:
    root = Path(root)
    write_tiny_flux2_hub(root / "models", dev=dev)
    for name in DATASETS:
        write_example_dataset(root / DATA / name, n=2, size=(32, 32))
    write_example_dataset(root / "data" / "example_image_dataset", n=2, size=(32, 32))
    return root
