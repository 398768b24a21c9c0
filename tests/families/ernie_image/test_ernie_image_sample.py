"""`difftune sample` on ERNIE-Image: the model folder in its official layout and the scripts' file list, a LoRA at a
strength and image-to-image; each written image equals the pipeline's own call. And validation during training
renders one image per prompt at the asked step."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import run_train
from difftune.cli.sample import main as sample
from support import write_example_dataset
from support.ernie_image import REPO, ernie_image_model_paths, load_tiny_ernie_image, write_tiny_ernie_image_hub

SIZE = ["--height", "32", "--width", "48", "--num_inference_steps", "2", "--torch_dtype", "float32", "--seed", "3",
        "--device", "cpu"]
KW = dict(seed=3, height=32, width=48, num_inference_steps=2, progress=False)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return write_tiny_ernie_image_hub(tmp_path_factory.mktemp("ernie_image_hub"))


def _same(path, image) -> bool:
    with Image.open(path) as written:
        return np.array_equal(np.asarray(written.convert("RGB")), np.asarray(image))


def _lora(hub, root):
    """A LoRA of the scripts' targets at rank 4, saved in the default layout."""
    from difftune.lora.formats import save_lora
    from difftune.families.ernie_image.components import LORA_TARGET_MODULES

    dit = load_tiny_ernie_image(hub).dit
    g = torch.Generator().manual_seed(1)
    state = {}
    for name, module in dit.named_modules():
        if isinstance(module, torch.nn.Linear) and name.endswith(tuple("." + t for t in LORA_TARGET_MODULES.split(","))):
            state[f"{name}.lora_A.weight"] = torch.randn(4, module.in_features, generator=g) / 10
            state[f"{name}.lora_B.weight"] = torch.randn(module.out_features, 4, generator=g) / 10
    assert len(state) == 2 * 2 * 4
    return save_lora(root / "lora.safetensors", {"dit": state}, {"dit": (4, 4, LORA_TARGET_MODULES)})


def test_model_folder_and_file_list(hub, tmp_path):
    ours = load_tiny_ernie_image(hub)("a red circle", **KW)
    assert sample(["--model_dir", str(hub / REPO), "--prompt", "a red circle", "--output", str(tmp_path / "d.png"),
                   *SIZE]) == 0
    assert _same(tmp_path / "d.png", ours)
    assert sample(["--model_paths", json.dumps(ernie_image_model_paths(hub)), "--prompt", "a red circle", "--output",
                   str(tmp_path / "p.png"), *SIZE]) == 0
    assert _same(tmp_path / "p.png", ours)
    assert Image.open(tmp_path / "p.png").size == (48, 32)


def test_lora_at_a_strength_and_image_to_image(hub, tmp_path):
    lora = _lora(hub, tmp_path)
    args = ["--model_dir", str(hub / REPO), "--prompt", "a cat", *SIZE]
    assert sample([*args, "--lora", str(lora), "--lora_alpha", "0.5", "--output", str(tmp_path / "l.png")]) == 0
    pipe = load_tiny_ernie_image(hub)
    plain = pipe("a cat", **KW)
    pipe.load_lora(pipe.dit, str(lora), alpha=0.5)
    assert _same(tmp_path / "l.png", pipe("a cat", **KW)) and not _same(tmp_path / "l.png", plain)
    g = torch.Generator().manual_seed(4)
    Image.fromarray((torch.rand(32, 48, 3, generator=g) * 255).to(torch.uint8).numpy()).save(tmp_path / "in.png")
    assert sample([*args, "--input_image", str(tmp_path / "in.png"), "--denoising_strength", "0.6", "--output",
                   str(tmp_path / "i.png")]) == 0
    pipe = load_tiny_ernie_image(hub)
    with Image.open(tmp_path / "in.png") as image:
        i2i = pipe("a cat", input_image=image.convert("RGB"), denoising_strength=0.6, **KW)
    assert _same(tmp_path / "i.png", i2i) and not _same(tmp_path / "i.png", plain)


def test_validation_renders_the_pipelines_samples_with_the_trained_lora(hub, tmp_path):
    meta = write_example_dataset(tmp_path / "data", n=2, size=(32, 32))
    run_train("--dataset_base_path", tmp_path / "data", "--dataset_metadata_path", meta, "--max_pixels", 1024,
              "--model_paths", json.dumps(ernie_image_model_paths(hub)), "--output_path", tmp_path / "out",
              "--lora_base_model", "dit", "--lora_target_modules", "to_q,to_v", "--lora_rank", 2,
              "--learning_rate", 1e-2, "--torch_dtype", "float32", "--no_progress", "--max_steps", 2,
              "--validation_prompts", "a dog|a cat", "--validation_steps", 2, "--validation_size", 32,
              "--validation_inference_steps", 2, "--enable_tensorboard_log", "false")
    grids = sorted((tmp_path / "out" / "validation").glob("step-*.png"))
    assert [p.name for p in grids] == ["step-000002.png"]
    grid = np.asarray(Image.open(grids[0]).convert("RGB"))
    assert grid.shape == (32, 64, 3)  # two prompts side by side
    assert grid.std() > 1  # an image, not a blank

