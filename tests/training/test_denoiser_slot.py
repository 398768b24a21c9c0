"""The denoiser's slot is the family's own name (a DiT's `dit`, a UNet's `unet`, the toy's `denoiser`): a full
training's file drops `pipe.<that slot>.` by default (the reference's `--remove_prefix_in_ckpt pipe.dit.` for a DiT
still works as given), and a LoRA in a denoiser-only layout (ComfyUI's diffusion_model., kohya's lora_unet_) loads
into that slot."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import make_image_dataset, run_train
from difftune.core.build import build_pipeline
from difftune.core.family import get_family
from difftune.models import ModelConfig
from support.toys import toy_family


@pytest.fixture(scope="module")
def toy(tmp_path_factory):
    root = tmp_path_factory.mktemp("slot")
    return toy_family.write_toy_models(root / "models"), make_image_dataset(root / "data", n=2, size=(32, 24))


def _train(toy, out, *flags):
    models, data = toy
    run_train("--family", "toy", "--model_paths", json.dumps(list(models.values())), "--torch_dtype", "float32",
              "--dataset_base_path", data.parent, "--dataset_metadata_path", data, "--output_path", out,
              "--learning_rate", 1e-2, "--max_steps", 1, "--seed", 3, "--no_progress", "--enable_tensorboard_log",
              "false", *flags)


def test_a_full_training_drops_the_denoisers_own_prefix_by_default(toy, tmp_path):
    _train(toy, tmp_path / "full", "--trainable_models", "denoiser")
    saved = load_file(str(next((tmp_path / "full").glob("*.safetensors"))))
    expected = set(toy_family.ToyDenoiser().state_dict())
    assert set(saved) == expected  # `pipe.denoiser.` dropped: the model's own names, as it loads them
    _train(toy, tmp_path / "kept", "--trainable_models", "denoiser", "--remove_prefix_in_ckpt", "pipe.")
    kept = load_file(str(next((tmp_path / "kept").glob("*.safetensors"))))
    assert set(kept) == {f"denoiser.{k}" for k in expected}  # a prefix given is the one removed


@pytest.mark.parametrize("layout", ["comfyui", "kohya"])
def test_a_denoiser_only_layout_loads_into_the_familys_denoiser_slot(toy, tmp_path, layout):
    _train(toy, tmp_path / layout, "--lora_base_model", "denoiser", "--lora_target_modules", "modulation",
           "--lora_rank", 2, "--lora_format", layout)
    path = next((tmp_path / layout).glob("*.safetensors"))
    prefix = {"comfyui": "diffusion_model.", "kohya": "lora_unet_"}[layout]
    assert all(k.startswith(prefix) for k in load_file(str(path)))
    spec = get_family("toy")
    models, _ = toy
    pipe = build_pipeline(spec, [ModelConfig(p) for p in models.values()], device="cpu", torch_dtype=torch.float32)
    before = {k: v.clone() for k, v in pipe.denoiser.state_dict().items()}
    pipe.load_lora(pipe.denoiser, str(path))
    changed = [k for k, v in pipe.denoiser.state_dict().items() if not torch.equal(v, before[k])]
    assert changed and all("modulation" in k for k in changed)
