"""FLUX.2's edit images (the `edit` feature): the reference's automatic size, a training run whose edit images alone
differ trains a different LoRA, and a batch whose samples' edit images differ in size is refused in one line."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from PIL import Image, ImageOps
from safetensors.torch import load_file

from conftest import run_train
from difftune.errors import UserError
from difftune.families.flux2.edit import auto_size, resize_edit_image
from support.flux2 import KLEIN_4B, klein_model_paths, load_tiny_klein, write_tiny_flux2_hub
from support.flux2.scripts import write_edit_dataset


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return write_tiny_flux2_hub(tmp_path_factory.mktemp("flux2_hub"))


def test_the_reference_auto_size():
    # about 1024 x 1024 pixels at the image's aspect ratio, sides rounded to multiples of 32
    assert auto_size(48, 32) == (1248, 832) and auto_size(32, 32) == (1024, 1024) and auto_size(32, 96) == (576, 1760)
    image = Image.new("RGB", (48, 32), (10, 20, 30))
    assert resize_edit_image(image, None).size == (1248, 832) and resize_edit_image(image, True).size == (1248, 832)
    assert resize_edit_image(Image.new("RGB", (50, 35)), False).size == (48, 32)  # floored to multiples of 16


def _train(hub, data, out):
    run_train("--task", "sft", "--dataset_base_path", data, "--dataset_metadata_path", data / "metadata.json",
              "--data_file_keys", "image,edit_image", "--extra_inputs", "edit_image", "--edit_image_auto_resize",
              "false", "--output_path", out, "--model_paths", json.dumps(klein_model_paths(hub)),
              "--tokenizer_path", hub / KLEIN_4B / "tokenizer", "--torch_dtype", "float32", "--learning_rate", 1e-2,
              "--max_steps", 1, "--seed", 3, "--no_progress", "--max_pixels", 1024, "--enable_tensorboard_log",
              "false", "--lora_base_model", "dit", "--lora_target_modules", "to_q,to_k,to_v", "--lora_rank", 4)
    return load_file(str(next(out.glob("*.safetensors"))))


def test_the_edit_images_alone_change_the_training(hub, tmp_path):
    data = tmp_path / "data"
    write_edit_dataset(data)
    other = tmp_path / "other"
    shutil.copytree(data, other)
    for path in other.glob("edit_*_a.png"):  # the first edit image of each row mirrored: nothing else differs
        with Image.open(path) as image:
            ImageOps.mirror(image.convert("RGB")).save(path)
    first, again, changed = _train(hub, data, tmp_path / "a"), _train(hub, data, tmp_path / "b"), \
        _train(hub, other, tmp_path / "c")
    assert all(torch.equal(first[k], again[k]) for k in first)
    assert max((first[k] - changed[k]).abs().max().item() for k in first) > 1e-6


def test_edit_images_of_different_sizes_in_one_batch_are_refused(hub):
    pipe = load_tiny_klein(hub)
    latents = torch.zeros(2, 128, 2, 2)
    edit = [[torch.zeros(128, 2, 3)], [torch.zeros(128, 2, 2)]]
    with pytest.raises(UserError, match="edit images of different sizes in one batch"):
        pipe.model_fn(latents=latents, timestep=torch.tensor([500.0, 500.0]), prompt_embeds=torch.zeros(2, 4, 96),
                      edit_latents=edit)
