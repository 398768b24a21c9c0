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
    write_edit_dataset(root / "data" / "diffsynth_example_dataset" / "qwen_image" / "Qwen-Image-Edit-2511")
    return root


def write_edit_dataset(root: str | os.PathLike, n: int = 2, size: tuple[int, int] = (32, 32)) -> Path:
    """Qwen-Image-Edit-2511's data set layout, which the klein scripts' commented edit commands train on:
    metadata.json rows with `image`, `prompt` and `edit_image` (a list of two files: the target's colours
    inverted, and a smaller crop of it)."""
    import json

    from PIL import Image, ImageOps

    root = Path(root)
    csv = write_example_dataset(root, n=n, size=size)
    rows = []
    for i, line in enumerate(csv.read_text().splitlines()[1:], 1):
        image, prompt = line.split(",", 1)
        with Image.open(root / image) as target:
            ImageOps.invert(target.convert("RGB")).resize((48, 32)).save(root / f"edit_{i}_a.png")
            target.convert("RGB").crop((0, 0, 16, 16)).resize((32, 32)).save(root / f"edit_{i}_b.png")
        rows.append({"image": image, "prompt": prompt.strip('"'), "edit_image": [f"edit_{i}_a.png", f"edit_{i}_b.png"]})
    csv.unlink()
    (root / "metadata.json").write_text(json.dumps(rows, indent=1))
    return root / "metadata.json"
