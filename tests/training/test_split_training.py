"""Split training gives the same weights as one-stage training; stages load only what they need; the cache
is resumable, fingerprinted, verifiable, and never pickled."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import LORA_TARGETS, make_image_dataset, model_paths_json, run_train, train_args
from difftune.errors import UserError

TE_TARGETS = "q_proj,k_proj,v_proj,o_proj"


@pytest.fixture()
def setup(tmp_path, tiny_repo):
    meta = make_image_dataset(tmp_path / "data", n=2)
    return tmp_path, meta, model_paths_json(tiny_repo)


def common(models, *extra, epochs=2, repeat=3):
    return ["--max_pixels", 4096, "--learning_rate", 1e-3, "--num_epochs", epochs, "--dataset_repeat", repeat,
            "--model_paths", models, "--torch_dtype", "float32", "--no_progress", "--seed", 3, *extra]


def max_diff(a_path, b_path):
    a, b = load_file(str(a_path)), load_file(str(b_path))
    assert a.keys() == b.keys() and len(a) > 0
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def one_stage_vs_split(tmp_path, meta, models, flags, task="sft", final="epoch-1.safetensors"):
    data = meta.parent
    run_train("--task", task, "--dataset_base_path", data, "--dataset_metadata_path", meta, "--output_path",
              tmp_path / "one", *common(models, *flags))
    run_train("--task", f"{task}:data_process", "--dataset_base_path", data, "--dataset_metadata_path", meta,
              "--output_path", tmp_path / "cache", *common(models, *flags, repeat=1))
    run_train("--task", f"{task}:train", "--dataset_base_path", tmp_path / "cache", "--output_path",
              tmp_path / "two", *common(models, *flags))
    return max_diff(tmp_path / "one" / final, tmp_path / "two" / final)


def test_dit_lora_split_equals_one_stage(setup):
    tmp_path, meta, models = setup
    flags = ["--lora_base_model", "dit", "--lora_target_modules", LORA_TARGETS, "--lora_rank", 4]
    assert one_stage_vs_split(tmp_path, meta, models, flags) <= 1e-5


def test_text_encoder_lora_split_equals_one_stage(setup):
    tmp_path, meta, models = setup
    flags = ["--lora_base_model", "text_encoder", "--lora_target_modules", TE_TARGETS, "--lora_rank", 4]
    assert one_stage_vs_split(tmp_path, meta, models, flags) <= 1e-5
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert "prompt" in json.dumps(manifest["frontier"])  # the prompt string is cached, not its embedding
    assert "prompt_embeds" not in manifest["frontier"]
    saved = load_file(str(tmp_path / "two" / "epoch-1.safetensors"))
    assert all(k.startswith("text_encoder.") for k in saved)


def test_full_dit_split_equals_one_stage(setup):
    tmp_path, meta, models = setup
    flags = ["--trainable_models", "dit", "--learning_rate", 1e-4]
    assert one_stage_vs_split(tmp_path, meta, models, flags) <= 1e-5


def test_direct_distill_split_equals_one_stage(tmp_path, tiny_repo):
    data = tmp_path / "data"
    make_image_dataset(data, n=2, size=(32, 32))
    rows = [{"image": f"image_{i + 1}.png", "prompt": p, "seed": 10 + i, "num_inference_steps": 2}
            for i, p in enumerate(["a dog", "a cat"])]
    (data / "metadata.json").write_text(json.dumps(rows))
    flags = ["--lora_base_model", "dit", "--lora_target_modules", LORA_TARGETS, "--lora_rank", 4, "--height", 32,
             "--width", 32]
    assert one_stage_vs_split(tmp_path, data / "metadata.json", model_paths_json(tiny_repo), flags,
                              task="direct_distill") <= 1e-5


def test_one_command_split_equals_one_stage(setup):
    tmp_path, meta, models = setup
    flags = ["--lora_base_model", "dit", "--lora_target_modules", LORA_TARGETS, "--lora_rank", 4]
    data = meta.parent
    run_train("--dataset_base_path", data, "--dataset_metadata_path", meta, "--output_path", tmp_path / "one",
              *common(models, *flags))
    summary = run_train("--task", "sft:split", "--dataset_base_path", data, "--dataset_metadata_path", meta,
                        "--output_path", tmp_path / "split", *common(models, *flags))
    assert summary["stage1"]["written"] == 2
    assert (tmp_path / "split" / "cache" / "manifest.json").exists()
    assert max_diff(tmp_path / "one" / "epoch-1.safetensors", tmp_path / "split" / "epoch-1.safetensors") <= 1e-5


def test_each_stage_loads_only_its_models(setup, monkeypatch):
    import difftune.models as models_pkg

    tmp_path, meta, models = setup
    built = []
    real = models_pkg.load_component

    def spy(config, *a, **k):
        loaded = real(config, *a, **k)
        built.append(loaded.name)
        return loaded

    monkeypatch.setattr(models_pkg, "load_component", spy)
    flags = ["--lora_base_model", "dit", "--lora_target_modules", LORA_TARGETS, "--lora_rank", 4]
    run_train("--task", "sft:data_process", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
              "--output_path", tmp_path / "cache", *common(models, *flags, repeat=1))
    assert sorted(built) == ["text_encoder", "vae"]
    built.clear()
    run_train("--task", "sft:train", "--dataset_base_path", tmp_path / "cache", "--output_path", tmp_path / "out",
              *common(models, *flags, epochs=1, repeat=1))
    assert built == ["dit"]  # the text encoder and the VAE are never constructed in stage 2


def test_stage1_rerun_resumes_and_refuses_other_settings(setup, capsys):
    tmp_path, meta, models = setup
    flags = ["--lora_base_model", "dit", "--lora_target_modules", LORA_TARGETS]
    args = ["--task", "sft:data_process", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
            "--output_path", tmp_path / "cache"]
    first = run_train(*args, *common(models, *flags, repeat=1))
    assert first["written"] == 2
    again = run_train(*args, *common(models, *flags, repeat=1))
    assert again["written"] == 0 and again["skipped_done"] == 2
    with pytest.raises(UserError, match="max_pixels"):
        run_train(*args, *common(models, *flags, repeat=1)[2:], "--max_pixels", 1024)
    rebuilt = run_train(*args, *common(models, *flags, repeat=1)[2:], "--max_pixels", 1024, "--rebuild_cache")
    assert rebuilt["written"] == 2


def test_stage2_refuses_foreign_or_unusable_caches(setup):
    tmp_path, meta, models = setup
    dit_lora = ["--lora_base_model", "dit", "--lora_target_modules", LORA_TARGETS]
    run_train("--task", "sft:data_process", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
              "--output_path", tmp_path / "cache", *common(models, *dit_lora, repeat=1))
    # the raw data set is not a cache
    with pytest.raises(UserError, match="raw dataset"):
        run_train("--task", "sft:train", "--dataset_base_path", meta.parent, "--output_path", tmp_path / "o1",
                  *common(models, *dit_lora))
    # a DiT-LoRA cache cannot feed text-encoder training: it lacks the prompt strings
    with pytest.raises(UserError, match="prompt"):
        run_train("--task", "sft:train", "--dataset_base_path", tmp_path / "cache", "--output_path", tmp_path / "o2",
                  *common(models, "--lora_base_model", "text_encoder", "--lora_target_modules", TE_TARGETS))
    # a cache of another family
    manifest_path = tmp_path / "cache" / "manifest.json"
    manifest = json.loads(manifest_path.read_text())
    manifest["family"] = "wan_video"
    manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(UserError, match="wan_video"):
        run_train("--task", "sft:train", "--dataset_base_path", tmp_path / "cache", "--output_path", tmp_path / "o3",
                  *common(models, *dit_lora))


def test_cache_verify_catches_corruption(setup):
    tmp_path, meta, models = setup
    run_train("--task", "sft:data_process", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
              "--output_path", tmp_path / "cache",
              *common(models, "--lora_base_model", "dit", "--lora_target_modules", LORA_TARGETS, repeat=1))
    from difftune.cli.main import main

    assert main(["cache", "verify", str(tmp_path / "cache")]) == 0
    shard = next((tmp_path / "cache").rglob("*.safetensors"))
    data = shard.read_bytes()
    shard.write_bytes(data[: len(data) // 2])
    assert main(["cache", "verify", str(tmp_path / "cache")]) == 1


def test_no_pickle_is_written_anywhere(setup):
    tmp_path, meta, models = setup
    run_train("--task", "sft:split", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
              "--output_path", tmp_path / "out", "--save_steps", 2,
              *common(models, "--lora_base_model", "dit", "--lora_target_modules", LORA_TARGETS, epochs=1))
    files = [p for p in (tmp_path / "out").rglob("*") if p.is_file()]
    assert any(p.suffix == ".safetensors" for p in files)
    for p in files:
        assert p.suffix not in (".pth", ".pt", ".bin", ".pkl", ".ckpt"), p
        head = p.read_bytes()[:2]
        assert head != b"\x80\x04" and head != b"\x80\x02" and head[:2] != b"PK", p  # pickle / torch zip


@pytest.fixture(scope="module")
def edit_repo(tmp_path_factory):
    from support import write_tiny_qwen_image

    return write_tiny_qwen_image(tmp_path_factory.mktemp("tiny_edit"), edit=True)


def test_qwen_image_edit_lora_split_equals_one_stage(tmp_path, edit_repo):
    """Qwen-Image-Edit: --extra_inputs edit_image, the processor found beside the text encoder."""
    data = tmp_path / "data"
    make_image_dataset(data, n=2, size=(32, 32))
    from PIL import Image

    for i in range(2):
        Image.new("RGB", (48, 40), (10 + 100 * i, 50, 200)).save(data / f"edit_{i + 1}.png")
    (data / "metadata.csv").write_text("image,edit_image,prompt\nimage_1.png,edit_1.png,make it red\n"
                                       "image_2.png,edit_2.png,make it blue\n")
    flags = ["--lora_base_model", "dit", "--lora_target_modules", LORA_TARGETS, "--lora_rank", 4,
             "--extra_inputs", "edit_image", "--edit_image_auto_resize", "false"]  # small edit images: fast
    assert one_stage_vs_split(tmp_path, data / "metadata.csv", model_paths_json(edit_repo), flags) <= 1e-5
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert "edit_latents" in manifest["frontier"]


def test_zero_cond_t_edit_2511_split_equals_one_stage_and_changes_the_result(tmp_path, edit_repo):
    """--zero_cond_t (Qwen-Image-Edit-2511) is a run-time setting of model_fn: never cached, same in both stages,
    and it changes what is trained."""
    data = tmp_path / "data"
    make_image_dataset(data, n=2, size=(32, 32))
    from PIL import Image

    for i in range(2):
        Image.new("RGB", (32, 32), (10 + 100 * i, 50, 200)).save(data / f"edit_{i + 1}.png")
    (data / "metadata.csv").write_text("image,edit_image,prompt\nimage_1.png,edit_1.png,make it red\n"
                                       "image_2.png,edit_2.png,make it blue\n")
    flags = ["--lora_base_model", "dit", "--lora_target_modules", LORA_TARGETS, "--lora_rank", 4,
             "--extra_inputs", "edit_image", "--edit_image_auto_resize", "false"]
    models = model_paths_json(edit_repo)
    assert one_stage_vs_split(tmp_path / "z", data / "metadata.csv", models, [*flags, "--zero_cond_t"]) <= 1e-5
    run_train("--task", "sft", "--dataset_base_path", data, "--dataset_metadata_path", data / "metadata.csv",
              "--output_path", tmp_path / "plain", *common(models, *flags))
    assert max_diff(tmp_path / "z" / "one" / "epoch-1.safetensors", tmp_path / "plain" / "epoch-1.safetensors") > 1e-4
