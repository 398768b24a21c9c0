"""FSDP2 really shards, and sharding changes nothing: 2 CPU processes (gloo) through `accelerate launch` with
examples/accelerate/fsdp.yaml train what one process with --gradient_accumulation_steps 2 trains.

accelerate turns an FSDP launch on processes without CUDA into DDP; difftune switches it back
(training/engines.py::fsdp_on_cpu), so these runs go through accelerate's own FSDP2 code (`fully_shard` per
block, sharded DTensor parameters, `no_sync`, the DTensor-aware clip). Each run proves it was sharded: the log
line names FSDP2 and its units, and the training state holds one shard file per process. The full-training run of
two processes is SIGKILLed after its first saved state and resumed, so its checkpoints also prove the resume.
"""

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from safetensors import safe_open

from conftest import LORA_TARGETS, make_image_dataset, model_paths_json, noise_image, run_train
from launching import CONFIGS, engine_line, kill_after_state, launch, max_diff

pytestmark = pytest.mark.slow  # each test launches 2 processes

FSDP = CONFIGS / "fsdp.yaml"
TOLERANCE = 1e-5  # fp32; the sums of gradients run in another order


@pytest.fixture(scope="module")
def workspace(tmp_path_factory, tiny_repo):
    root = tmp_path_factory.mktemp("sharded")
    meta = make_image_dataset(root / "data", n=4, size=(32, 32))
    # Row 2 is a picture whose compressed data is scrambled in the middle: it passes the check made when the data
    # set is built, so the process that decodes it finds it bad and its micro-batch has no sample. Under FSDP2 that
    # process must still run the (collective) forward: on a stand-in sample, weighted 0.
    noise = noise_image((32, 32), 40, seed=1)
    noise.save(root / "data" / "whole.png")
    data = bytearray((root / "data" / "whole.png").read_bytes())
    data[len(data) // 2: len(data) // 2 + 16] = bytes(b ^ 0xFF for b in data[len(data) // 2: len(data) // 2 + 16])
    (root / "data" / "cut.jpg").write_bytes(bytes(data))
    lines = meta.read_text().splitlines()
    bad = root / "data" / "with_bad_row.csv"
    bad.write_text("\n".join([*lines[:2], 'cut.jpg,"broken"', *lines[2:]]) + "\n")
    return {"root": root, "meta": meta, "bad": bad, "models": model_paths_json(tiny_repo),
            "dit": Path(tiny_repo) / "transformer"}


def common(ws):
    return ["--model_paths", ws["models"], "--torch_dtype", "float32", "--max_pixels", 1024, "--seed", 3,
            "--learning_rate", 1e-3, "--num_epochs", 2, "--dataset_repeat", 2, "--no_progress", "--batch_size", 1]


def full_flags(ws):
    """Full training of the DiT, one stage, from the data set with a bad row: 5 rows x 2 = 10 steps of 2 samples."""
    return ["--task", "sft", "--dataset_base_path", ws["bad"].parent, "--dataset_metadata_path", ws["bad"],
            "--on_bad_sample", "skip", *common(ws), "--trainable_models", "dit", "--save_steps", 5,
            "--save_state_steps", 3]


def moved(path: Path, ws) -> float:
    """How far training moved the weights from the released ones (so that equality means something)."""
    from safetensors.torch import load_file

    base = {}
    for f in sorted(ws["dit"].glob("*.safetensors")):
        base.update(load_file(str(f)))
    trained = load_file(str(path))
    return max((trained[k] - base[k]).abs().max().item() for k in trained)


@pytest.fixture(scope="module")
def full_runs(workspace):
    """Two FSDP2 processes SIGKILLed as soon as their first training state is saved, then resumed on two processes;
    and one process with accumulation 2, uninterrupted. (One interrupted run proves both claims: the two processes
    train what one trains, and a resumed run continues where the killed one stopped.)"""
    root = workspace["root"]
    two = root / "full-two"
    at = kill_after_state(root, FSDP, *full_flags(workspace), "--output_path", two, state_root=two / "state",
                          min_step=3)
    assert at < 10  # really interrupted before the end
    killed = root / "killed-state" / f"step-{at}"
    shutil.copytree(two / "state" / f"step-{at}", killed)  # for the one-process resume (the run goes on in `two`)
    done = launch(root, FSDP, *full_flags(workspace), "--output_path", two, "--resume_from_checkpoint", "latest")
    assert f"resumed from {two / 'state' / f'step-{at}'}: step {at}" in done.stdout
    run_train(*full_flags(workspace), "--gradient_accumulation_steps", 2, "--output_path", root / "full-one")
    return {"two": two, "one": root / "full-one", "stdout": done.stdout, "killed": killed}


def test_two_fsdp2_processes_killed_and_resumed_train_what_one_process_trains(workspace, full_runs):
    line = engine_line(full_runs["stdout"])
    assert line.startswith("engine: FSDP2 over 2 processes (cpu), FULL_SHARD, one unit per QwenImageTransformerBlock")
    assert "whole on every process (frozen): text_encoder, vae" in line
    two, one = full_runs["two"], full_runs["one"]
    # --save_steps and the final file: one consolidated safetensors each, with the one-process run's keys
    assert sorted(p.name for p in two.glob("*.safetensors")) == ["step-10.safetensors", "step-5.safetensors"]
    for name in ("step-5.safetensors", "step-10.safetensors"):
        assert max_diff(one / name, two / name) <= TOLERANCE, name
    assert moved(two / "step-10.safetensors", workspace) > 100 * TOLERANCE
    # the bad row was met (each epoch, twice) and left out as one process leaves it out
    assert json.loads((two / "bad_samples.json").read_text()) == json.loads((one / "bad_samples.json").read_text())

    # the training state is sharded: one safetensors part per process, each with its half of every block tensor
    state = two / "state" / "step-9"
    meta = json.loads((state / "state.json").read_text())
    assert meta["format"] == 2 and meta["settings"]["world_size"] == 2
    files = sorted(str(p.relative_to(state)) for p in state.rglob("*") if p.is_file())
    assert files == ["rng-0.safetensors", "rng-1.safetensors", "shards/shard-00001-model-00001-of-00001.safetensors",
                     "shards/shard-00002-model-00001-of-00001.safetensors", "state.json"]
    key = "model.pipe_models.dit.transformer_blocks.0.attn.to_q.weight"
    rows = []
    for part in sorted((state / "shards").glob("*.safetensors")):
        with safe_open(str(part), framework="pt") as f:
            rows.append(f.get_slice(key).get_shape()[0])
    from safetensors.torch import load_file

    full_rows = load_file(str(two / "step-10.safetensors"))["transformer_blocks.0.attn.to_q.weight"].shape[0]
    assert rows == [full_rows // 2, full_rows // 2]


def test_a_sharded_state_resumes_on_one_process(workspace, full_runs):
    """The killed two-process run's sharded state on ONE unsharded process: the same samples per step (1 x 1 x 2 =
    2 x 1 x 1), so no --force_resume is needed and the result is the uninterrupted run's."""
    other = workspace["root"] / "killed-one"
    shutil.copytree(full_runs["killed"], other / "state" / full_runs["killed"].name)
    run_train(*full_flags(workspace), "--gradient_accumulation_steps", 2, "--output_path", other,
              "--resume_from_checkpoint", "latest")
    assert max_diff(full_runs["one"] / "step-10.safetensors", other / "step-10.safetensors") <= TOLERANCE


def test_split_stage2_lora_with_checkpointing_clipping_and_validation(workspace, capsys):
    root = workspace["root"]
    lora = ["--lora_base_model", "dit", "--lora_target_modules", LORA_TARGETS, "--lora_rank", 4]
    cache = root / "cache"
    run_train("--task", "sft:data_process", "--dataset_base_path", workspace["meta"].parent, "--dataset_metadata_path",
              workspace["meta"], *common(workspace), *lora, "--output_path", cache, "--validation_prompts", "a dog")
    stage2 = ["--task", "sft:train", "--dataset_base_path", cache, *common(workspace), *lora,
              "--use_gradient_checkpointing", "--validation_prompts", "a dog", "--validation_size", 32,
              "--validation_inference_steps", 2]
    clip = ["--max_grad_norm", 0.02]
    two = launch(root, FSDP, *stage2, *clip, "--output_path", root / "s2-two")
    assert engine_line(two.stdout).startswith("engine: FSDP2 over 2 processes (cpu), FULL_SHARD, one unit per "
                                              "QwenImageTransformerBlock (2 units) in dit; training state sharded")
    run_train(*stage2, *clip, "--gradient_accumulation_steps", 2, "--output_path", root / "s2-one")
    run_train(*stage2, "--gradient_accumulation_steps", 2, "--output_path", root / "s2-unclipped")
    one, two_dir = root / "s2-one" / "epoch-1.safetensors", root / "s2-two" / "epoch-1.safetensors"
    assert max_diff(one, two_dir) <= TOLERANCE
    assert max_diff(one, root / "s2-unclipped" / "epoch-1.safetensors") > 100 * TOLERANCE  # the clipping bites

    # validation under FSDP2: every process renders (the denoiser's forward is collective), the main one writes
    a = np.asarray(Image.open(root / "s2-one" / "validation" / "step-000008.png")).astype(int)
    b = np.asarray(Image.open(root / "s2-two" / "validation" / "step-000008.png")).astype(int)
    assert a.shape == b.shape and np.abs(a - b).max() <= 1 and a.std() > 1


@pytest.fixture(scope="module")
def lora_state(workspace):
    """A LoRA run's sharded training state (2 FSDP2 processes, 1 step) and the flags that resume it on one process
    (the same 2 samples per step)."""
    out = workspace["root"] / "lora-state"
    flags = ["--dataset_base_path", workspace["meta"].parent, "--dataset_metadata_path", workspace["meta"], *common(workspace),
             "--lora_base_model", "dit", "--lora_target_modules", "to_q", "--lora_rank", 2, "--save_state_steps", 1]
    launch(workspace["root"], FSDP, *flags, "--max_steps", 1, "--output_path", out)
    (state,) = (out / "state").glob("step-*")
    return {"state": state, "flags": [*flags, "--gradient_accumulation_steps", 2]}


@pytest.mark.parametrize("damage", ["deleted", "cut"])
def test_a_sharded_state_with_a_shard_deleted_or_cut_is_refused_naming_it(workspace, lora_state, damage, tmp_path):
    """One shard gone (a partial copy): torch's planner saw half of every tensor and raised a traceback naming no
    file. Now one line naming the shard, before anything is written under the output folder."""
    from difftune.errors import UserError

    out = tmp_path / "out"
    shutil.copytree(lora_state["state"], out / "state" / lora_state["state"].name)
    shard = out / "state" / lora_state["state"].name / "shards" / "shard-00002-model-00001-of-00001.safetensors"
    if damage == "deleted":
        shard.unlink()
    else:
        shard.write_bytes(shard.read_bytes()[:200])
    before = sorted(p for p in out.rglob("*"))
    with pytest.raises(UserError) as err:
        run_train(*lora_state["flags"], "--output_path", out, "--resume_from_checkpoint", "latest")
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{shard}: "), msg
    assert ("missing from the training state" if damage == "deleted" else "truncated training state file") in msg
    assert sorted(p for p in out.rglob("*")) == before
