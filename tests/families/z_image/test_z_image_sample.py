"""`difftune sample` on Z-Image: the model folder of Turbo, a Fun ControlNet's control image, Omni-Base's edit
images (each written image equals the pipeline's own call), and the family's flags refused for another family."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from difftune.cli.sample import main as sample
from difftune.errors import UserError
from support.z_image import (CONTROLNET_FILES, CONTROLNET_REPO, OMNI_REPO, TURBO_REPO, hub_entry,
                                            load_tiny_z_image, omni_model_paths, write_tiny_z_image_hub)

SIZE = ["--height", "32", "--width", "32", "--num_inference_steps", "2", "--torch_dtype", "float32", "--seed", "3",
        "--device", "cpu"]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return write_tiny_z_image_hub(tmp_path_factory.mktemp("z_image_hub"))


def _picture(path, seed):
    g = torch.Generator().manual_seed(seed)
    Image.fromarray((torch.rand(32, 32, 3, generator=g) * 255).to(torch.uint8).numpy()).save(path)
    return path


def _same(path, image) -> bool:
    with Image.open(path) as written:
        return np.array_equal(np.asarray(written.convert("RGB")), np.asarray(image))


def test_turbo_folder(hub, tmp_path, capsys):
    assert sample(["--model_dir", str(hub / TURBO_REPO), "--prompt", "a red circle", "--output",
                   str(tmp_path / "t.png"), *SIZE]) == 0
    ours = load_tiny_z_image(hub)("a red circle", seed=3, height=32, width=32, num_inference_steps=2, progress=False)
    assert _same(tmp_path / "t.png", ours)


def test_fun_controlnet_control_image(hub, tmp_path):
    control = _picture(tmp_path / "control.png", 1)
    paths = [hub_entry(hub, TURBO_REPO, f) for f in ("transformer", "text_encoder", "vae")] + \
        [str(hub / CONTROLNET_REPO / CONTROLNET_FILES[0])]
    args = ["--model_paths", json.dumps(paths), "--prompt", "a cat", "--controlnet_image", str(control), *SIZE]
    assert sample([*args, "--output", str(tmp_path / "c.png"), "--controlnet_scale", "0.5"]) == 0
    pipe = load_tiny_z_image(hub, controlnet=CONTROLNET_FILES[0])
    kw = dict(seed=3, height=32, width=32, num_inference_steps=2, progress=False)
    with Image.open(control) as c:
        c = c.convert("RGB")
        assert _same(tmp_path / "c.png", pipe("a cat", controlnet_image=c, controlnet_scale=0.5, **kw))
        assert not _same(tmp_path / "c.png", pipe("a cat", controlnet_image=c, **kw))  # the scale was used


def test_omni_base_edit_images(hub, tmp_path):
    edits = [_picture(tmp_path / f"e{i}.png", 10 + i) for i in range(2)]
    args = ["--model_paths", json.dumps(omni_model_paths(hub)), "--prompt", "make it blue", "--tokenizer_path",
            str(hub / TURBO_REPO / "tokenizer"), "--edit_image", str(edits[0]), "--edit_image", str(edits[1]), *SIZE]
    assert sample([*args, "--output", str(tmp_path / "o.png")]) == 0
    pipe = load_tiny_z_image(hub, dit_repo=OMNI_REPO, siglip=True)
    images = [Image.open(e).convert("RGB") for e in edits]
    ours = pipe("make it blue", edit_image=images, seed=3, height=32, width=32, num_inference_steps=2,
                progress=False)
    assert _same(tmp_path / "o.png", ours)


def test_z_image_flags_are_refused_for_another_family(tmp_path):
    from support import tiny_qwen_image_paths, write_tiny_qwen_image

    repo = write_tiny_qwen_image(tmp_path / "qwen")
    paths = [p if len(p) > 1 else p[0] for p in tiny_qwen_image_paths(repo).values()]
    with pytest.raises(UserError, match="--controlnet_image: the qwen_image family does not take it"):
        sample(["--model_paths", json.dumps(paths), "--prompt", "x", "--controlnet_image", "c.png", *SIZE])
