"""`difftune sample` on FLUX.2: klein's model folder and FLUX.2-dev's files with its embedded guidance (each written
image equals the pipeline's own call)."""

from __future__ import annotations

import json

import numpy as np
import pytest
from PIL import Image

from difftune.cli.sample import main as sample
from support.flux2 import DEV, KLEIN_4B, dev_model_paths, load_tiny_dev, load_tiny_klein, write_tiny_flux2_hub

SIZE = ["--height", "32", "--width", "32", "--num_inference_steps", "2", "--torch_dtype", "float32", "--seed", "3",
        "--device", "cpu"]
KW = dict(seed=3, height=32, width=32, num_inference_steps=2, progress=False)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return write_tiny_flux2_hub(tmp_path_factory.mktemp("flux2_hub"), dev=True)


def _same(path, image) -> bool:
    with Image.open(path) as written:
        return np.array_equal(np.asarray(written.convert("RGB")), np.asarray(image))


def test_klein_folder(hub, tmp_path):
    assert sample(["--model_dir", str(hub / KLEIN_4B), "--prompt", "a red circle", "--output",
                   str(tmp_path / "k.png"), *SIZE]) == 0
    assert _same(tmp_path / "k.png", load_tiny_klein(hub)("a red circle", **KW))


def test_dev_embedded_guidance(hub, tmp_path):
    args = ["--model_paths", json.dumps(dev_model_paths(hub)), "--tokenizer_path", str(hub / DEV / "tokenizer"),
            "--prompt", "a cat", *SIZE]
    assert sample([*args, "--output", str(tmp_path / "d.png"), "--embedded_guidance", "2"]) == 0
    pipe = load_tiny_dev(hub)
    assert _same(tmp_path / "d.png", pipe("a cat", embedded_guidance=2.0, **KW))
    assert not _same(tmp_path / "d.png", pipe("a cat", **KW))  # the guidance was used


def test_klein_edit_images(hub, tmp_path):
    import torch

    paths = []
    for i in range(2):
        g = torch.Generator().manual_seed(10 + i)
        Image.fromarray((torch.rand(32, 48, 3, generator=g) * 255).to(torch.uint8).numpy()).save(tmp_path / f"e{i}.png")
        paths += ["--edit_image", str(tmp_path / f"e{i}.png")]
    assert sample(["--model_dir", str(hub / KLEIN_4B), "--prompt", "make it blue", "--output",
                   str(tmp_path / "e.png"), *paths, "--edit_image_auto_resize", "false", *SIZE]) == 0
    images = [Image.open(tmp_path / f"e{i}.png").convert("RGB") for i in range(2)]
    pipe = load_tiny_klein(hub)
    assert _same(tmp_path / "e.png", pipe("make it blue", edit_image=images, edit_image_auto_resize=False, **KW))
    assert not _same(tmp_path / "e.png", pipe("make it blue", **KW))
