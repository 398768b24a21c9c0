"""`difftune example-workspace DIR`: the demo family's tiny random model under DIR/models/ (where its hub id
resolves) and a 4-image data set in the reference's layout under DIR/data/, so the reference's command lines run
unchanged in DIR."""

from __future__ import annotations

import importlib
import os
import sys
from pathlib import Path


def write_example_dataset(root: str | os.PathLike, n: int = 4, size: tuple[int, int] = (64, 64)) -> Path:
    """A tiny image data set in the reference's layout: image_<i>.png and metadata.csv (image,prompt)."""
    from PIL import Image, ImageDraw

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    colors = [("red", (220, 40, 40)), ("blue", (40, 60, 220)), ("green", (40, 180, 70)), ("yellow", (230, 220, 50))]
    lines = ["image,prompt"]
    for i in range(n):
        name, rgb = colors[i % len(colors)]
        back_name, back = colors[(i + 1) % len(colors)]
        img = Image.new("RGB", size, back)
        w, h = size
        ImageDraw.Draw(img).ellipse((w // 4, h // 4, 3 * w // 4, 3 * h // 4), fill=rgb)
        img.save(root / f"image_{i + 1}.png")
        lines.append(f'image_{i + 1}.png,"a {name} circle on a {back_name} background"')
    (root / "metadata.csv").write_text("\n".join(lines) + "\n")
    return root / "metadata.csv"


def write_example_workspace(root: str | os.PathLike) -> Path:
    """DIR/models/<hub id>/ (the family's tiny model, written by its package's `tiny.write_example_model`) and
    DIR/data/example_image_dataset/."""
    from .demo import demo_family

    spec = demo_family()
    package = sys.modules[spec.pipeline.__module__].__package__
    root = Path(root)
    importlib.import_module(f"{package}.tiny").write_example_model(root / "models")
    write_example_dataset(root / "data" / "example_image_dataset")
    return root
