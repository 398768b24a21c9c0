"""`difftune sample` (with a trained LoRA), validation images during training, preset LoRA, FP8 frozen models."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from conftest import LORA_TARGETS, make_image_dataset, model_paths_json, run_train


def cli(*argv):
    from difftune.cli.main import main

    return main([str(a) for a in argv])


@pytest.fixture()
def trained_lora(tmp_path, tiny_repo):
    meta = make_image_dataset(tmp_path / "data", n=2)
    run_train("--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--max_pixels", 4096,
              "--dataset_repeat", 5, "--learning_rate", 5e-3, "--model_paths", model_paths_json(tiny_repo),
              "--output_path", tmp_path / "out", "--lora_base_model", "dit", "--lora_target_modules", LORA_TARGETS,
              "--lora_rank", 4, "--torch_dtype", "float32", "--no_progress")
    return tmp_path / "out" / "epoch-0.safetensors"


def test_sample_command_with_and_without_lora(tmp_path, tiny_repo, trained_lora):
    common = ["sample", "--model_dir", tiny_repo, "--prompt", "a dog", "--height", 32, "--width", 32,
              "--num_inference_steps", 3, "--torch_dtype", "float32", "--seed", 1]
    assert cli(*common, "--output", tmp_path / "base.png") == 0
    assert cli(*common, "--output", tmp_path / "lora.png", "--lora", trained_lora) == 0
    base = np.asarray(Image.open(tmp_path / "base.png"), dtype=np.float32)
    lora = np.asarray(Image.open(tmp_path / "lora.png"), dtype=np.float32)
    assert base.shape == lora.shape == (32, 32, 3)
    assert np.abs(base - lora).max() > 0  # the LoRA changed the image
    assert cli(*common, "--output", tmp_path / "again.png") == 0
    assert np.array_equal(base, np.asarray(Image.open(tmp_path / "again.png"), dtype=np.float32))  # seeded


def test_validation_images_one_stage(tmp_path, tiny_repo):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    meta = make_image_dataset(tmp_path / "data", n=2)
    run_train("--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--max_pixels", 4096,
              "--dataset_repeat", 4, "--model_paths", model_paths_json(tiny_repo), "--output_path", tmp_path / "out",
              "--lora_base_model", "dit", "--lora_target_modules", "to_q", "--lora_rank", 2, "--torch_dtype",
              "float32", "--no_progress", "--validation_prompts", "a dog|a cat", "--validation_steps", 4,
              "--validation_size", 32, "--validation_inference_steps", 2)
    pngs = sorted((tmp_path / "out" / "validation").glob("*.png"))
    assert [p.name for p in pngs] == ["step-000004.png", "step-000008.png"]
    assert Image.open(pngs[0]).size == (64, 32)  # two prompts side by side
    acc = EventAccumulator(str(next((tmp_path / "out" / "logs").rglob("events.out.tfevents*")).parent),
                           size_guidance={"images": 0})
    acc.Reload()
    assert len(acc.Images("validation")) == 2


def test_validation_in_stage2_uses_cached_prompts_without_the_text_encoder(tmp_path, tiny_repo):
    meta = make_image_dataset(tmp_path / "data", n=2)
    flags = ["--max_pixels", 4096, "--model_paths", model_paths_json(tiny_repo), "--lora_base_model", "dit",
             "--lora_target_modules", "to_q", "--lora_rank", 2, "--torch_dtype", "float32", "--no_progress",
             "--validation_prompts", "a dog", "--validation_size", 32, "--validation_inference_steps", 2]
    run_train("--task", "sft:data_process", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
              "--output_path", tmp_path / "cache", *flags)
    assert (tmp_path / "cache" / "validation" / "embeds.safetensors").exists()
    # stage 2 is given only the DiT: prompts come from the cache, the VAE from where stage 1 recorded it
    dit_only = json.dumps([json.loads(model_paths_json(tiny_repo))[0]])
    flags[flags.index("--model_paths") + 1] = dit_only
    run_train("--task", "sft:train", "--dataset_base_path", tmp_path / "cache", "--output_path", tmp_path / "out",
              "--dataset_repeat", 2, *flags)
    assert (tmp_path / "out" / "validation" / "step-000004.png").exists()


def test_preset_lora_is_merged_before_training(tmp_path, tiny_repo, trained_lora):
    meta = make_image_dataset(tmp_path / "data", n=2)
    common = ["--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--max_pixels", 4096,
              "--dataset_repeat", 2, "--model_paths", model_paths_json(tiny_repo), "--lora_base_model", "dit",
              "--lora_target_modules", "to_q,to_k", "--lora_rank", 2, "--torch_dtype", "float32", "--no_progress"]
    run_train(*common, "--output_path", tmp_path / "plain")
    run_train(*common, "--output_path", tmp_path / "diff", "--preset_lora_path", trained_lora,
              "--preset_lora_model", "dit")
    a = load_file(str(tmp_path / "plain" / "epoch-0.safetensors"))
    b = load_file(str(tmp_path / "diff" / "epoch-0.safetensors"))
    assert a.keys() == b.keys()  # only the new LoRA is saved, not the merged one
    assert max((a[k] - b[k]).abs().max().item() for k in a) > 0  # trained on top of a different base


def test_fp8_frozen_dit_trains_a_lora(tmp_path, tiny_repo):
    meta = make_image_dataset(tmp_path / "data", n=2)
    summary = run_train("--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--max_pixels", 4096,
                        "--dataset_repeat", 2, "--model_paths", model_paths_json(tiny_repo), "--lora_base_model", "dit",
                        "--lora_target_modules", "to_q,to_k", "--lora_rank", 2, "--fp8_models", "dit,text_encoder",
                        "--output_path", tmp_path / "out", "--no_progress")
    sd = load_file(str(tmp_path / "out" / "epoch-0.safetensors"))
    assert summary["steps"] == 4 and all(torch.isfinite(v).all() for v in sd.values())
    assert {v.dtype for v in sd.values()} == {torch.float32}
