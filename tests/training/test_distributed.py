"""Several processes (`accelerate launch`, gloo on CPU) give what one process gives.

Two processes with --batch_size 1 train the same weights as one process with
--gradient_accumulation_steps 2 (training/sampler.py hands every layout the same samples per optimizer
step, and the noise is drawn per sample), from the stage-1 cache, with model and optimizer offload; two processes
with --batch_size 2 what one process with --batch_size 4 trains, one stage, from mixed sizes. Stage 1 on two
processes writes the same cache as one process, each sample once, and reports a bad row that only rank 1 met. Every
run also proves it had two processes: only world size 2 writes a second rank's RNG file and `"world_size": 2` in the
training state, or a second cache part.

Launching: `accelerate launch --cpu --num_processes 2` silently runs ONE process; what works on a machine
without GPUs is `--multi_gpu` (or the DDP config file) with `Accelerator(cpu=True)`, which difftune sets
when CUDA is absent (research notes, deps.md §6).
"""

import json
import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import LORA_TARGETS, make_image_dataset, model_paths_json, noise_image, run_train
from difftune.cache import CacheReader

pytestmark = pytest.mark.slow  # each test launches 2 processes: 25-60 s on 2 cores

ROOT = Path(__file__).resolve().parents[2]
DDP_CONFIG = ROOT / "examples" / "accelerate" / "multi_gpu_ddp.yaml"
TOLERANCE = 1e-6
DIST_VARIABLES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_repo):
    root = tmp_path_factory.mktemp("distributed")
    meta = make_image_dataset(root / "data", n=4, size=(32, 32))
    # For stage 1: the same 4 images plus, in row 2, a picture whose compressed data is scrambled in the middle
    # (a PNG, under a .jpg name: PIL reads by content; its length and end marker are whole). It passes the check
    # made when the dataset is built, so only the process that decodes it (rank 1: row index 1) finds it bad.
    noise = noise_image((32, 32), 40, seed=1)
    noise.save(root / "data" / "whole.png")
    data = bytearray((root / "data" / "whole.png").read_bytes())
    data[len(data) // 2: len(data) // 2 + 16] = bytes(b ^ 0xFF for b in data[len(data) // 2: len(data) // 2 + 16])
    (root / "data" / "cut.jpg").write_bytes(bytes(data))
    lines = meta.read_text().splitlines()
    (root / "data" / "with_bad_row.csv").write_text("\n".join([*lines[:2], 'cut.jpg,"broken"', *lines[2:]]) + "\n")
    (root / "hf_home").mkdir()  # no user accelerate config can leak into the launches
    return {"root": root, "meta": meta, "meta_bad": root / "data" / "with_bad_row.csv",
            "models": model_paths_json(tiny_repo)}


def flags(ws, *extra, repeat=2):
    return ["--model_paths", ws["models"], "--torch_dtype", "float32", "--max_pixels", 1024, "--seed", 3,
            "--learning_rate", 1e-3, "--num_epochs", 2, "--dataset_repeat", repeat, "--no_progress",
            "--lora_base_model", "dit", "--lora_target_modules", LORA_TARGETS, "--lora_rank", 4,
            "--find_unused_parameters", *extra]


def raw_data(ws, meta="meta"):
    return ["--dataset_base_path", ws[meta].parent, "--dataset_metadata_path", ws[meta]]


def stage1(ws, output):
    return ["--task", "sft:data_process", *raw_data(ws, "meta_bad"), "--on_bad_sample", "skip",
            "--output_path", output, *flags(ws, repeat=1)]


def launch(ws, *argv, config_file=None):
    """`accelerate launch` with 2 CPU processes, as a user would type it; returns the finished process."""
    if config_file is None:
        how = ["--multi_gpu", "--num_processes", "2", "--num_machines", "1"]
    else:  # the GPU config, with the overrides a machine without GPUs needs
        how = ["--config_file", str(config_file), "--num_processes", "2"]
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", *how, "--mixed_precision", "no",
           "--dynamo_backend", "no", "--main_process_port", "0", "-m", "difftune.train", *map(str, argv)]
    inherited = {k: v for k, v in os.environ.items()  # nothing of an earlier (in-process) distributed run
                 if not k.startswith(("ACCELERATE_", "FSDP_")) and k not in DIST_VARIABLES}
    env = {**inherited, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "HF_HOME": str(ws["root"] / "hf_home"),
           "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false"}
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=400, cwd=ws["root"])
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def assert_two_processes_trained(output: Path, steps: int):
    """Only a run with world size 2 writes rank 1's RNG state and records world_size 2."""
    state = output / "state" / f"step-{steps}"
    settings = json.loads((state / "state.json").read_text())["settings"]
    assert settings["world_size"] == 2 and settings["gradient_accumulation_steps"] == 1
    assert sorted(p.name for p in state.glob("rng-*.safetensors")) == ["rng-0.safetensors", "rng-1.safetensors"]


def compare_lora(one: Path, two: Path) -> float:
    a, b = load_file(str(one)), load_file(str(two))
    assert a.keys() == b.keys() and any(".lora_B." in k for k in a)
    # LoRA B starts at zero: the run moved it by far more than the tolerance, so equality means something
    assert max(v.abs().max().item() for k, v in a.items() if ".lora_B." in k) > 100 * TOLERANCE
    return max((a[k] - b[k]).abs().max().item() for k in a)


@pytest.fixture(scope="module")
def one_process_cache(workspace):
    out = workspace["root"] / "cache-one"
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run_train(*stage1(workspace, out))
    assert any("skipping bad sample" in str(w.message) and "cut.jpg" in str(w.message) for w in caught)
    return out


def shard_ids(cache: Path) -> dict[str, tuple[list[str], list[str]]]:
    """(written ids, skipped ids) per cache part, read from the committed shard indexes (duplicates kept)."""
    parts = {}
    for part in sorted(cache.glob("part-*")):
        indexes = [json.loads(index.read_text()) for index in sorted(part.glob("shard-*.json"))]
        parts[part.name] = ([i for index in indexes for i in index["samples"]],
                            [i for index in indexes for i in index.get("skipped", {})])
    return parts


def test_stage1_on_two_processes_writes_the_one_process_cache(workspace, one_process_cache, tmp_path):
    two = tmp_path / "cache-two"
    launch(workspace, *stage1(workspace, two))
    manifest = json.loads((two / "manifest.json").read_text())
    assert manifest["world_size"] == 2
    parts = shard_ids(two)
    assert sorted(parts) == ["part-00000", "part-00001"]
    for name in parts:
        assert json.loads((two / name / "complete.json").read_text())["world_size"] == 2
    written = [i for ids, _ in parts.values() for i in ids]
    assert all(ids for ids, _ in parts.values()) and len(written) == len(set(written)) == 4  # none twice

    # The bad row was rank 1's to encode; the report (written by rank 0) still lists it, as one process does.
    bad_id = parts["part-00001"][1]
    assert len(bad_id) == 1 and bad_id[0].startswith("000001-") and parts["part-00000"][1] == []
    report = json.loads((two / "bad_samples.json").read_text())
    assert report == json.loads((one_process_cache / "bad_samples.json").read_text())
    assert [(b["row"], b["id"], Path(b["file"]).name) for b in report] == [(2, bad_id[0], "cut.jpg")]

    a, b = CacheReader(one_process_cache), CacheReader(two)
    assert a.ids == b.ids == sorted(written) and len(a) == 4
    for i in range(len(a)):
        x, y = a[i], b[i]
        assert x.keys() == y.keys() and {"input_latents", "prompt_embeds"} <= x.keys()
        for key, value in x.items():
            if isinstance(value, torch.Tensor):
                assert value.dtype == y[key].dtype and value.shape == y[key].shape, key
                assert (value.double() - y[key].double()).abs().max().item() <= TOLERANCE, (x["_id"], key)
            else:
                assert value == y[key], (x["_id"], key)


def test_stage2_on_two_processes_trains_what_one_process_with_accumulation_trains(workspace, one_process_cache,
                                                                                 tmp_path):
    """With model and optimizer offload and gradient checkpointing on the two processes (none of them on the one):
    each process sees other samples, so only gradients synced through the offloaded blocks give the one process's
    LoRA."""
    cache = ["--dataset_base_path", one_process_cache]
    proc = launch(workspace, "--task", "sft:train", *cache, "--output_path", tmp_path / "two", "--batch_size", 1,
                  "--save_state", "--enable_model_cpu_offload", "--enable_optimizer_cpu_offload",
                  "--use_gradient_checkpointing", *flags(workspace))
    assert "engine: DDP over 2 processes" in proc.stdout and "model offload: dit: 2 of 2 blocks" in proc.stdout
    assert "optimizer offload:" in proc.stdout
    run_train("--task", "sft:train", *cache, "--output_path", tmp_path / "one", "--batch_size", 1,
              "--gradient_accumulation_steps", 2, *flags(workspace))
    assert_two_processes_trained(tmp_path / "two", steps=8)
    assert compare_lora(tmp_path / "one" / "epoch-1.safetensors", tmp_path / "two" / "epoch-1.safetensors") <= TOLERANCE


def test_two_processes_with_batch_2_train_what_one_process_with_batch_4_trains(workspace, tmp_path):
    """Mixed aspect ratios and prompt lengths: buckets, padded prompts and partial final batches under DDP, launched
    through examples/accelerate/multi_gpu_ddp.yaml (so the DDP config is exercised too)."""
    root = tmp_path / "mixed"
    root.mkdir()
    rows = ["image,prompt"]
    for i, (w, h) in enumerate([(32, 32), (32, 16), (16, 32)] * 3):
        noise_image((w, h), 20 + 7 * i, seed=i).save(root / f"m{i}.png")
        rows.append(f'm{i}.png,"{"a long prompt about a thing " * (i % 3 + 1)}"')
    (root / "metadata.csv").write_text("\n".join(rows) + "\n")
    data = ["--dataset_base_path", root, "--dataset_metadata_path", root / "metadata.csv"]
    proc = launch(workspace, "--task", "sft", *data, "--output_path", tmp_path / "two", "--batch_size", 2,
                  "--save_state", *flags(workspace, repeat=1), config_file=DDP_CONFIG)
    # 9 samples in three buckets of 3: one step of 3 samples each (fewer than 4: partial)
    assert "batches: 9 samples in 3 bucket(s) -> 3 optimizer step(s) of up to 4 per epoch (3 partial)" in proc.stdout
    assert_two_processes_trained(tmp_path / "two", steps=6)  # 3 steps x 2 epochs
    run_train("--task", "sft", *data, "--output_path", tmp_path / "one", "--batch_size", 4, *flags(workspace, repeat=1))
    assert compare_lora(tmp_path / "one" / "epoch-1.safetensors", tmp_path / "two" / "epoch-1.safetensors") <= 1e-5
