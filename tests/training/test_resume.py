"""Exact resume: a run killed with SIGKILL and resumed ends with the same weights as an uninterrupted run. A resume
that cannot be exact (a changed batch layout, no state, a state with NaN, a cut file or a step past the end) is one
line, and replaces nothing."""

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file

from conftest import LORA_TARGETS, make_image_dataset, model_paths_json, run_train
from difftune.errors import UserError


def train_cmd(data, meta, models, out, *extra):
    return [sys.executable, "-m", "difftune", "train", "--dataset_base_path", str(data), "--dataset_metadata_path",
            str(meta), "--max_pixels", "4096", "--dataset_repeat", "12", "--num_epochs", "2",
            "--learning_rate", "1e-3", "--model_paths", models, "--output_path", str(out), "--lora_base_model", "dit",
            "--lora_target_modules", LORA_TARGETS, "--lora_rank", "4", "--torch_dtype", "float32",
            "--gradient_accumulation_steps", "2", "--save_state_steps", "3", "--no_progress", *map(str, extra)]


def run_in_process(cmd):
    """A train_cmd's run in this process: the same flags without a Python start-up and imports (~10 s). Only the run
    that is killed needs a process of its own; the uninterrupted reference and the resumed run run here."""
    assert cmd[1:4] == ["-m", "difftune", "train"], cmd[:4]
    return run_train(*cmd[4:])


def kill_after_state(cmd, state_root: Path, min_step: int, timeout=300):
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            steps = [int(p.name.split("-")[1]) for p in state_root.glob("step-*")] if state_root.exists() else []
            if steps and max(steps) >= min_step:
                proc.send_signal(signal.SIGKILL)
                proc.wait()
                return max(steps)
            if proc.poll() is not None:
                raise AssertionError(f"the run ended before it could be killed: {proc.stderr.read().decode()[-2000:]}")
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
    raise AssertionError("no state was saved in time")


@pytest.mark.slow
@pytest.mark.parametrize("stage", ["one_stage", "stage2"])
def test_sigkill_then_resume_gives_the_same_weights(tmp_path, tiny_repo, stage, capsys):
    meta = make_image_dataset(tmp_path / "data", n=2)
    models = model_paths_json(tiny_repo)
    data = meta.parent
    extra = []
    if stage == "stage2":
        run_train("--task", "sft:data_process", "--dataset_base_path", data, "--dataset_metadata_path", meta,
                  "--max_pixels", 4096, "--model_paths", models, "--output_path", tmp_path / "cache",
                  "--lora_base_model", "dit", "--lora_target_modules", LORA_TARGETS, "--torch_dtype", "float32",
                  "--no_progress")
        data, extra = tmp_path / "cache", ["--task", "sft:train"]

    def cmd(out, *more):
        c = train_cmd(data, meta, models, out, *extra, *more)
        if stage == "stage2":  # stage 2 reads the cache, not the metadata
            i = c.index("--dataset_metadata_path")
            del c[i:i + 2]
        return c

    run_in_process(cmd(tmp_path / "full"))
    killed_at = kill_after_state(cmd(tmp_path / "killed"), tmp_path / "killed" / "state", min_step=4)
    assert killed_at < 12  # really interrupted before the end (2 epochs x 12 samples / accumulation 2)
    capsys.readouterr()
    run_in_process(cmd(tmp_path / "killed", "--resume_from_checkpoint", "latest"))
    assert "resumed from" in capsys.readouterr().out
    a = load_file(str(tmp_path / "full" / "epoch-1.safetensors"))
    b = load_file(str(tmp_path / "killed" / "epoch-1.safetensors"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
    assert len(list((tmp_path / "killed" / "state").glob("step-*"))) <= 2  # keeps the last 2


def test_resume_refuses_a_changed_batch_layout(tmp_path, tiny_repo):
    meta = make_image_dataset(tmp_path / "data", n=2)
    common = ["--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--max_pixels", 4096,
              "--dataset_repeat", 4, "--model_paths", model_paths_json(tiny_repo), "--output_path", tmp_path / "out",
              "--lora_base_model", "dit", "--lora_target_modules", "to_q", "--lora_rank", 2, "--torch_dtype",
              "float32", "--no_progress", "--save_state_steps", 2]
    run_train(*common, "--max_steps", 2)
    with pytest.raises(UserError, match=r"gradient_accumulation_steps \(1 -> 2\)"):
        run_train(*common, "--gradient_accumulation_steps", 2, "--resume_from_checkpoint", "latest")
    summary = run_train(*common, "--gradient_accumulation_steps", 2, "--resume_from_checkpoint", "latest",
                        "--force_resume")
    assert summary["steps"] >= 2


def test_resume_latest_without_state_is_a_clear_error(tmp_path, tiny_repo):
    meta = make_image_dataset(tmp_path / "data", n=2)
    with pytest.raises(UserError, match="no saved training state"):
        run_train("--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--model_paths",
                  model_paths_json(tiny_repo), "--output_path", tmp_path / "out", "--lora_base_model", "dit",
                  "--lora_target_modules", "to_q", "--torch_dtype", "float32", "--resume_from_checkpoint", "latest")


@pytest.fixture
def saved_state(tmp_path, tiny_repo):
    meta = make_image_dataset(tmp_path / "data", n=2)
    common = ["--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--max_pixels", 4096,
              "--dataset_repeat", 2, "--model_paths", model_paths_json(tiny_repo), "--output_path", tmp_path / "out",
              "--lora_base_model", "dit", "--lora_target_modules", "to_q", "--lora_rank", 2, "--torch_dtype",
              "float32", "--no_progress", "--save_state_steps", 2, "--num_epochs", 2]
    run_train(*common, "--max_steps", 2)
    (state,) = (tmp_path / "out" / "state").glob("step-*")
    return {"common": common, "state": state, "out": tmp_path / "out"}


def _resume(saved, *extra):
    return run_train(*saved["common"], "--resume_from_checkpoint", "latest", *extra)


def _damage(path, edit):
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        meta, values = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
    key = sorted(k for k in values if values[k].is_floating_point())[0]
    values[key] = edit(values[key].clone())
    save_file(values, str(path), metadata=meta)
    return key


@pytest.mark.parametrize("name", ["optimizer.safetensors", "weights.safetensors"])
def test_nan_in_a_saved_state_is_refused_naming_the_file(saved_state, name):
    path = saved_state["state"] / name
    key = _damage(path, lambda t: t.view(-1).fill_(float("nan")).view(t.shape))
    before = {p: p.read_bytes() for p in saved_state["out"].glob("*.safetensors")}
    with pytest.raises(UserError) as err:
        _resume(saved_state)
    import re

    assert re.fullmatch(rf"{re.escape(str(path))}: tensor '{re.escape(key)}' holds [1-9]\d* NaN and 0 infinite "
                        rf"value\(s\)", str(err.value)), str(err.value)
    assert {p: p.read_bytes() for p in saved_state["out"].glob("*.safetensors")} == before  # no NaN LoRA saved


def test_global_step_past_the_end_is_refused_and_replaces_nothing(saved_state):
    state_json = saved_state["state"] / "state.json"
    meta = json.loads(state_json.read_text())
    meta["position"]["global_step"] = 999
    state_json.write_text(json.dumps(meta))
    args = saved_state["out"] / "training_args.json"
    before = args.read_bytes()
    with pytest.raises(UserError) as err:
        _resume(saved_state)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"--resume_from_checkpoint {saved_state['state']}: its global_step 999 "
                                              f"is at or past this run's last step (8)")
    assert args.read_bytes() == before


def test_cut_weights_file_in_a_state_names_the_file(saved_state):
    path = saved_state["state"] / "weights.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) - 100])
    with pytest.raises(UserError) as err:
        _resume(saved_state)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{path}: ") and "truncated" in msg


# -- a state tampered with (by hand, a bad copy, a hostile file): one line naming the file, nothing written ---------

def _output_files(out: Path) -> dict:
    return {str(p.relative_to(out)): p.read_bytes() for p in out.rglob("*") if p.is_file()}


def _refused(saved, *extra) -> str:
    """The resume's one-line refusal; the output folder (states, logs, run records) exactly as it was."""
    before = _output_files(saved["out"])
    with pytest.raises(UserError) as err:
        _resume(saved, *extra)
    msg = str(err.value)
    assert "\n" not in msg, msg
    assert _output_files(saved["out"]) == before
    return msg


def _edit_json(saved, edit):
    state_json = saved["state"] / "state.json"
    meta = json.loads(state_json.read_text())
    edit(meta)
    state_json.write_text(json.dumps(meta))
    return state_json


def test_weights_cut_in_half_is_refused_naming_the_file_before_anything_is_written(saved_state):
    path = saved_state["state"] / "weights.safetensors"
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    msg = _refused(saved_state)
    assert msg.startswith(f"{path}: truncated training state file"), msg


@pytest.mark.parametrize("value", ["abc", -4, 1.5, None, True])
def test_a_global_step_that_is_no_count_is_refused_naming_the_state_file(saved_state, value):
    state_json = _edit_json(saved_state, lambda m: m["position"].__setitem__("global_step", value))
    msg = _refused(saved_state)
    assert msg.startswith(f"{state_json}: position 'global_step' is {json.dumps(value)}, not a whole number "
                          f"0 or more"), msg
    assert not list((saved_state["out"] / "state").glob("step--*"))


def test_a_stray_state_folder_with_a_bad_name_does_not_break_latest(saved_state):
    """`state/step--4` (what a negative global_step wrote before) and `state/step-x` are no states: `latest` takes
    the newest real one."""
    for name in ("step--4", "step-x"):
        shutil.copytree(saved_state["state"], saved_state["state"].parent / name)
    summary = _resume(saved_state)
    assert summary["steps"] == 8


def test_a_truncated_state_json_is_refused_naming_it(saved_state):
    state_json = saved_state["state"] / "state.json"
    text = state_json.read_text()
    state_json.write_text(text[:len(text) // 2])
    msg = _refused(saved_state)
    assert msg.startswith(f"{state_json}: not a readable training state (truncated or not JSON:"), msg


def test_a_state_json_with_a_part_missing_is_refused_naming_it(saved_state):
    state_json = _edit_json(saved_state, lambda m: m.pop("optimizer"))
    msg = _refused(saved_state)
    assert msg.startswith(f"{state_json}: 'optimizer' is missing or not"), msg


@pytest.mark.parametrize("how", ["garbage", "wrong_size", "missing"])
def test_garbage_rng_state_is_refused_naming_the_file(saved_state, how):
    import torch
    from safetensors.torch import save_file

    path = saved_state["state"] / "rng-0.safetensors"
    if how == "garbage":
        path.write_bytes(b"garbage" * 10)
    elif how == "wrong_size":
        save_file({"rank0.torch_cpu": torch.zeros(7, dtype=torch.uint8)}, str(path))
    else:
        path.unlink()
    msg = _refused(saved_state)
    assert msg.startswith(f"{path}: "), msg
    assert {"garbage": "unreadable", "wrong_size": "not a random generator state",
            "missing": "missing from the training state"}[how] in msg


def test_a_state_past_the_last_epoch_is_refused_and_replaces_nothing(saved_state):
    _edit_json(saved_state, lambda m: m["position"].__setitem__("epoch", 999))
    msg = _refused(saved_state)
    assert msg.startswith(f"--resume_from_checkpoint {saved_state['state']}: its epoch 999 is past this run's "
                          f"last epoch (1: --num_epochs 2, counted from 0)"), msg


def test_global_step_past_the_end_writes_nothing_at_all(saved_state):
    _edit_json(saved_state, lambda m: m["position"].__setitem__("global_step", 999))
    msg = _refused(saved_state)
    assert "its global_step 999 is at or past this run's last step (8)" in msg


@pytest.mark.parametrize("name", ["optimizer.safetensors", "weights.safetensors"])
def test_a_tensor_cut_to_another_shape_is_refused_naming_the_file_and_tensor(saved_state, name):
    from safetensors.torch import load_file, save_file

    path = saved_state["state"] / name
    tensors = load_file(str(path))
    key = sorted(k for k in tensors if tensors[k].dim() >= 2)[0]
    shape = list(tensors[key].shape)
    tensors[key] = tensors[key][:1].contiguous()
    save_file(tensors, str(path))
    msg = _refused(saved_state)
    assert msg.startswith(f"{path}: tensor '{key}' has shape [1, {shape[1]}]"), msg
    assert f"[{shape[0]}, {shape[1]}]" in msg
