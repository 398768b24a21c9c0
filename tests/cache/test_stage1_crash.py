"""Stage 1 killed mid-way resumes without re-encoding finished samples and yields the same cache."""

import signal
import subprocess
import sys
import time

import pytest
import torch

from conftest import LORA_TARGETS, make_image_dataset, model_paths_json, run_train
from difftune.cache import CacheReader
from test_resume import run_in_process


def stage1_cmd(meta, models, out, *extra):
    return [sys.executable, "-m", "difftune", "train", "--task", "sft:data_process", "--dataset_base_path",
            str(meta.parent), "--dataset_metadata_path", str(meta), "--max_pixels", "4096", "--model_paths", models,
            "--output_path", str(out), "--lora_base_model", "dit", "--lora_target_modules", LORA_TARGETS,
            "--torch_dtype", "float32", "--data_process_batch_size", "1", "--cache_commit_every", "3",
            "--no_progress", *extra]


def read_all(path):
    reader = CacheReader(str(path))
    return {reader[i]["_id"]: reader[i] for i in range(len(reader))}


@pytest.mark.slow
def test_sigkill_in_stage1_then_rerun(tmp_path, tiny_repo, capsys):
    meta = make_image_dataset(tmp_path / "data", n=30, size=(64, 64))
    models = model_paths_json(tiny_repo)
    run_train("--task", "sft:data_process", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
              "--max_pixels", 4096, "--model_paths", models, "--output_path", tmp_path / "ref", "--lora_base_model",
              "dit", "--lora_target_modules", LORA_TARGETS, "--torch_dtype", "float32", "--no_progress",
              "--data_process_batch_size", 1)
    proc = subprocess.Popen(stage1_cmd(meta, models, tmp_path / "cache"), stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE)
    deadline = time.time() + 300
    while time.time() < deadline:
        shards = list((tmp_path / "cache").glob("part-*/shard-*.json"))
        if len(shards) >= 2:
            proc.send_signal(signal.SIGKILL)
            break
        assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
        time.sleep(0.02)
    proc.wait()
    partial = CacheReader(str(tmp_path / "cache"), allow_incomplete=True)
    done_before = len(partial)
    assert 0 < done_before < 30
    capsys.readouterr()
    run_in_process(stage1_cmd(meta, models, tmp_path / "cache"))  # the rerun: in this process
    assert f"resuming stage 1: {done_before} sample(s) already cached" in capsys.readouterr().out
    ref, got = read_all(tmp_path / "ref"), read_all(tmp_path / "cache")
    assert ref.keys() == got.keys() and len(ref) == 30
    for key in ref:
        for name, value in ref[key].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, got[key][name]), (key, name)


def test_batched_stage1_matches_one_at_a_time(tmp_path, tiny_repo):
    meta = make_image_dataset(tmp_path / "data", n=4, size=(64, 64))
    models = model_paths_json(tiny_repo)
    common = ["--task", "sft:data_process", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
              "--max_pixels", 4096, "--model_paths", models, "--lora_base_model", "dit", "--lora_target_modules",
              LORA_TARGETS, "--torch_dtype", "float32", "--no_progress"]
    run_train(*common, "--output_path", tmp_path / "one", "--data_process_batch_size", 1)
    run_train(*common, "--output_path", tmp_path / "four", "--data_process_batch_size", 4)
    a, b = read_all(tmp_path / "one"), read_all(tmp_path / "four")
    assert a.keys() == b.keys()
    for key in a:
        for name, value in a[key].items():
            if isinstance(value, torch.Tensor):
                assert value.shape == b[key][name].shape
                assert (value.float() - b[key][name].float()).abs().max() <= 1e-5, (key, name)


def test_default_stage1_batch_is_bounded_by_pixels():
    """Without --data_process_batch_size: up to 8 samples and one megapixel in all (a 1024x1024 image alone, a clip
    by its frames), as measured on an H200 where batching 1024x1024 images bought 1.03x for 4.8x the memory."""
    from PIL import Image

    from difftune.training.stage1 import auto_batch_size

    def image(w, h):
        return Image.new("RGB", (w, h))

    assert auto_batch_size({"image": image(1024, 1024), "prompt": "a", "_row": 3}) == 1
    assert auto_batch_size({"image": image(512, 512)}) == 4
    assert auto_batch_size({"image": image(256, 256)}) == 8
    assert auto_batch_size({"image": image(64, 64)}) == 8
    assert auto_batch_size({"edit_image": [image(512, 512)] * 2, "image": image(512, 512)}) == 1
    assert auto_batch_size({"video": [image(416, 240)] * 5}) == 2
    assert auto_batch_size({"prompt": "no pictures"}) == 8


def test_stage1_batch_out_of_gpu_memory_goes_on_one_at_a_time(tmp_path, tiny_repo, monkeypatch, capsys):
    """A batch that runs out of GPU memory is encoded again one sample at a time (said once), never lost: the cache
    equals a one-at-a-time run's."""
    from difftune.core.pipeline import BasePipeline

    meta = make_image_dataset(tmp_path / "data", n=4, size=(64, 64))
    common = ["--task", "sft:data_process", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
              "--max_pixels", 4096, "--model_paths", model_paths_json(tiny_repo), "--lora_base_model", "dit",
              "--lora_target_modules", LORA_TARGETS, "--torch_dtype", "float32", "--no_progress"]
    run_train(*common, "--output_path", tmp_path / "one", "--data_process_batch_size", 1)
    run_units, batches = BasePipeline.run_units, []

    def out_of_memory_when_batched(self, values, *a, **k):
        batches.append(values.get("batch_size", 1))
        if values.get("batch_size", 1) > 1:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return run_units(self, values, *a, **k)

    monkeypatch.setattr(BasePipeline, "run_units", out_of_memory_when_batched)
    capsys.readouterr()
    run_train(*common, "--output_path", tmp_path / "four", "--data_process_batch_size", 4)
    out = capsys.readouterr().out
    assert out.count("ran out of GPU memory; encoding one at a time") == 1, out
    assert batches == [4, 1, 1, 1, 1]
    a, b = read_all(tmp_path / "one"), read_all(tmp_path / "four")
    assert a.keys() == b.keys() and len(a) == 4
    for key in a:
        for name, value in a[key].items():
            if isinstance(value, torch.Tensor):
                assert torch.equal(value, b[key][name]), (key, name)
