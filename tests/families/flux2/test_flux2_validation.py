"""Validation during training on FLUX.2-dev (Mistral-3, embedded guidance): a one-stage LoRA run renders its prompts
at the family's sampling guidance after each step."""

from __future__ import annotations

import json

import numpy as np
from PIL import Image

from conftest import run_train
from support import write_example_dataset
from support.flux2 import DEV, dev_model_paths, write_tiny_flux2_hub


def test_dev_renders_validation_images(tmp_path):
    hub = write_tiny_flux2_hub(tmp_path / "hub", dev=True)
    meta = write_example_dataset(tmp_path / "data", n=2, size=(32, 32))
    run_train("--task", "sft", "--dataset_base_path", tmp_path / "data", "--dataset_metadata_path", meta,
              "--model_paths", json.dumps(dev_model_paths(hub)), "--tokenizer_path", hub / DEV / "tokenizer",
              "--output_path", tmp_path / "out", "--lora_base_model", "dit", "--lora_target_modules", "to_q,to_k,to_v",
              "--max_steps", 2, "--no_progress", "--max_pixels", 1024, "--torch_dtype", "float32",
              "--validation_prompts", "a red circle|a cat", "--validation_steps", 1, "--validation_size", 32,
              "--validation_inference_steps", 2, "--enable_tensorboard_log", "false")
    renders = sorted((tmp_path / "out" / "validation").glob("step-*.png"))
    assert [p.name for p in renders] == ["step-000001.png", "step-000002.png"]
    with Image.open(renders[-1]) as image:
        pixels = np.asarray(image.convert("RGB"))
    assert pixels.shape[0] >= 32 and pixels.shape[1] >= 64 and pixels.std() > 1  # two prompts side by side
