"""DeepSpeed ZeRO through examples/accelerate's configs, on CPU processes (DeepSpeed's CPU accelerator, gloo).

DeepSpeed comes with the `test` extra (`difftune[deepspeed]`: an sdist that builds without torch, its ops left to be
compiled when first used, which these configs never need), so CI runs this module; without DeepSpeed it is
skipped. What needs no DeepSpeed (the configs build their plugins, the
flags decide clipping and micro-batch, the state layout is what the reader expects) runs always, in
tests/training/test_launch_configs.py and tests/training/test_engines.py.
"""

import json
import shutil

import numpy as np
import pytest
from PIL import Image

from conftest import LORA_TARGETS, make_image_dataset, model_paths_json, run_train
from launching import CONFIGS, ROOT, engine_line, launch, max_diff

pytest.importorskip("deepspeed", reason="DeepSpeed is not installed (pip install deepspeed)")
pytestmark = pytest.mark.slow

# DeepSpeed sums the two processes' gradients in its own buckets and order: fp32 results agree to ~1.4e-5 here
TOLERANCE = 5e-5


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_repo):
    root = tmp_path_factory.mktemp("deepspeed")
    meta = make_image_dataset(root / "data", n=4, size=(32, 32))
    (root / "examples").symlink_to(ROOT / "examples")  # the single-GPU config names its JSON file from here
    ws = {"root": root, "models": model_paths_json(tiny_repo)}
    run_train("--task", "sft:data_process", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
              *common(ws), "--trainable_models", "dit", "--output_path", root / "cache",
              "--validation_prompts", "a dog")
    return ws


def common(ws):
    return ["--model_paths", ws["models"], "--torch_dtype", "float32", "--max_pixels", 1024, "--seed", 3,
            "--learning_rate", 1e-3, "--num_epochs", 2, "--dataset_repeat", 2, "--no_progress", "--batch_size", 1]


def stage2(ws, *extra):
    return ["--task", "sft:train", "--dataset_base_path", ws["root"] / "cache", *common(ws), *extra]


@pytest.fixture(scope="module")
def zero3(workspace):
    root = workspace["root"]
    flags = stage2(workspace, "--trainable_models", "dit", "--max_grad_norm", 0.05, "--save_state_steps", 3,
                   "--validation_prompts", "a dog", "--validation_size", 32, "--validation_inference_steps", 2)
    proc = launch(root, CONFIGS / "deepspeed_zero3.yaml", *flags, "--output_path", root / "zero3")
    run_train(*flags, "--gradient_accumulation_steps", 2, "--output_path", root / "one")
    # tests/training/deepspeed_site kept DeepSpeed from compiling its CPU shared-memory op (a minute or two)
    assert "shm_comm" not in proc.stdout + proc.stderr
    return {"stdout": proc.stdout, "flags": flags}


def test_zero3_on_two_processes_trains_what_one_process_trains(workspace, zero3):
    root = workspace["root"]
    assert engine_line(zero3["stdout"]) == "engine: DeepSpeed ZeRO-3 over 2 processes (cpu), gradient clipping 0.05"
    # the checkpoint: the fp32 master weights gathered whole, the one-process run's keys and dtype
    assert max_diff(root / "one" / "epoch-1.safetensors", root / "zero3" / "epoch-1.safetensors") <= TOLERANCE
    state = root / "zero3" / "state" / "step-6"
    assert json.loads((state / "state.json").read_text())["format"] == 3
    assert sorted(p.name for p in state.iterdir()) == ["deepspeed-0.safetensors", "deepspeed-1.safetensors",
                                                       "rng-0.safetensors", "rng-1.safetensors", "state.json"]
    # ZeRO-3's forward is collective: every process renders, the main one writes
    a = np.asarray(Image.open(root / "one" / "validation" / "step-000008.png")).astype(int)
    b = np.asarray(Image.open(root / "zero3" / "validation" / "step-000008.png")).astype(int)
    assert np.abs(a - b).max() <= 1


def test_a_zero3_state_resumes_under_another_stage_and_process_count(workspace, zero3):
    """ZeRO-3's state of two processes at step 3, continued by ONE process under ZeRO-2 with the optimizer on the CPU
    (DeepSpeed's CPU Adam) and accumulation 2: the uninterrupted run's weights."""
    root = workspace["root"]
    out = root / "resumed"
    shutil.copytree(root / "zero3" / "state" / "step-3", out / "state" / "step-3")
    proc = launch(root, CONFIGS / "deepspeed_zero2_offload.yaml", *zero3["flags"], "--gradient_accumulation_steps", 2,
                  "--output_path", out, "--resume_from_checkpoint", "latest", processes=1)
    assert engine_line(proc.stdout).startswith("engine: DeepSpeed ZeRO-2 over 1 process (cpu), optimizer on cpu")
    assert "resumed from" in proc.stdout
    assert max_diff(root / "zero3" / "epoch-1.safetensors", out / "epoch-1.safetensors") <= 1e-5


def test_single_gpu_zero3_offload_lora_recipe_trains_what_a_plain_run_trains(workspace):
    root = workspace["root"]
    flags = stage2(workspace, "--lora_base_model", "dit", "--lora_target_modules", LORA_TARGETS, "--lora_rank", 4,
                   "--use_gradient_checkpointing", "--initialize_model_on_cpu")
    proc = launch(root, CONFIGS / "deepspeed_zero3_offload_single_gpu.yaml", *flags, "--output_path",
                  root / "lora-offload", processes=1)
    assert engine_line(proc.stdout) == ("engine: DeepSpeed ZeRO-3 over 1 process (cpu), optimizer on cpu, "
                                        "parameters on cpu, no gradient clipping")
    run_train(*flags, "--output_path", root / "lora-plain")
    assert max_diff(root / "lora-plain" / "epoch-1.safetensors", root / "lora-offload" / "epoch-1.safetensors") \
        <= TOLERANCE
