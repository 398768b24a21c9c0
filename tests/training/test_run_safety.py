"""Nothing of an earlier run is lost: a failing state write, a failing run, two runs into one folder, and a
run stopped by SIGTERM / Ctrl-C (it saves, then exits cleanly)."""

import errno
import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest
from safetensors.torch import load_file

from conftest import make_image_dataset, model_paths_json
from test_bad_input import base_args, cli, one_line_error


def tree(root):
    """Every file under `root` -> its bytes."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def test_disk_full_while_saving_a_training_state(tmp_path, tiny_repo, capsys, monkeypatch):
    # before: safetensors' own error came up as a traceback from state.py
    import difftune.training.state as state

    meta = make_image_dataset(tmp_path / "data", n=2)
    out = tmp_path / "out"
    args = [*base_args(meta, out, tiny_repo), "--save_state_steps", 1, "--dataset_repeat", 2]
    assert cli(*args, "--max_steps", 1) == 0
    capsys.readouterr()
    earlier, everything = tree(out / "state"), tree(out)
    real = state.save_file

    def full_disk(tensors, filename, metadata=None):
        real(tensors, filename, metadata)
        if filename.endswith("weights.safetensors"):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(state, "save_file", full_disk)
    line = one_line_error(capsys, cli(*args, "--max_steps", 2, "--resume_from_checkpoint", "latest"),
                          str(out / "state" / "step-2" / "weights.safetensors"), "no space left on the device", "bytes")
    assert "Traceback" not in line
    assert tree(out / "state") == earlier  # step-1 intact, no step-2, no temporary directory
    after = tree(out)  # nor was training_args.json replaced: the run saved nothing
    assert {k: after.get(k) for k in everything} == everything


# -- nothing of an earlier run overwritten by a run that fails; one run per folder -------------------------------

def earlier_run(tmp_path, tiny_repo, capsys):
    meta = make_image_dataset(tmp_path / "data", n=2)
    out = tmp_path / "out"
    assert cli(*base_args(meta, out, tiny_repo), "--enable_csv_log", "--save_state_steps", 1) == 0
    capsys.readouterr()
    return meta, out, tree(out)


def new_files(out, before):
    return sorted(set(tree(out)) - set(before))


def test_failed_run_leaves_every_earlier_file_byte_identical(tmp_path, tiny_repo, capsys):
    # before: the failed run replaced training_args.json and loss.csv
    meta, out, before = earlier_run(tmp_path, tiny_repo, capsys)
    assert {"training_args.json", "loss.csv", "epoch-0.safetensors"} <= set(before)
    failing = [*base_args(meta, out, tiny_repo), "--enable_csv_log", "--dataset_repeat", 20, "--learning_rate", 1e30]
    one_line_error(capsys, cli(*failing), "non-finite loss")
    after = tree(out)
    assert {k: after.get(k) for k in before} == before
    added = new_files(out, before)  # only the failed run's own record and TensorBoard folder
    (run_id,) = {p.split("/")[1] for p in added if p.startswith("runs/")} - {p.split("/")[1] for p in before
                                                                             if p.startswith("runs/")}
    assert all(p.startswith((f"runs/{run_id}/", f"logs/{run_id}/")) for p in added), added
    assert '"learning_rate": 1e+30' in (out / "runs" / run_id / "training_args.json").read_text()
    assert not (out / ".difftune.lock").exists()


def test_a_run_that_saves_updates_training_args(tmp_path, tiny_repo, capsys):
    meta, out, before = earlier_run(tmp_path, tiny_repo, capsys)
    assert cli(*base_args(meta, out, tiny_repo), "--learning_rate", 5e-4) == 0
    runs = sorted((out / "runs").iterdir())
    assert len(runs) == 2
    newest = (runs[-1] / "training_args.json").read_text()
    assert (out / "training_args.json").read_text() == newest and '"learning_rate": 0.0005' in newest
    assert json.loads(newest)["run_id"] == runs[-1].name
    assert len({p.parent for p in (out / "logs").rglob("events.out.tfevents*")}) == 2  # a TensorBoard run each
    assert not (out / ".difftune.lock").exists()


def write_lock(out, pid, host=None, command="difftune train --output_path elsewhere"):
    out.mkdir(parents=True, exist_ok=True)
    lock = out / ".difftune.lock"
    lock.write_text(json.dumps({"pid": pid, "host": host or socket.gethostname(), "started": "2025-01-01T00:00:00+00:00",
                                "command": command, "token": "x"}))
    return lock


def test_a_second_run_into_a_busy_folder_is_refused(tmp_path, tiny_repo, capsys):
    meta, out, before = earlier_run(tmp_path, tiny_repo, capsys)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        lock = write_lock(out, holder.pid)
        held = lock.read_bytes()
        line = one_line_error(capsys, cli(*base_args(meta, out, tiny_repo)), "--output_path", str(out),
                              "another difftune run is writing there", f"pid {holder.pid}", socket.gethostname(),
                              "difftune train --output_path elsewhere", str(lock))
        assert "Traceback" not in line
        assert lock.read_bytes() == held  # the holder's lock is left alone
        lock.unlink()
        assert tree(out) == before
    finally:
        holder.kill()
        holder.wait()
    # a lock from another host cannot be checked: refused too
    write_lock(out, 1, host="some-other-host")
    one_line_error(capsys, cli(*base_args(meta, out, tiny_repo)), "pid 1 on some-other-host")


def test_a_stale_lock_is_taken_over_with_a_note(tmp_path, tiny_repo, capsys):
    meta, out, _ = earlier_run(tmp_path, tiny_repo, capsys)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    write_lock(out, gone.pid)
    assert cli(*base_args(meta, out, tiny_repo)) == 0
    assert f"took over the lock of a run that is no longer running (pid {gone.pid}" in capsys.readouterr().out
    assert not (out / ".difftune.lock").exists()


def test_lock_is_exclusive_and_only_the_main_process_takes_it(tmp_path):
    from difftune.errors import UserError
    from difftune.training.run_lock import OutputLock, output_lock

    with output_lock(tmp_path, enabled=False):  # a non-main process under accelerate
        assert not (tmp_path / ".difftune.lock").exists()
    with output_lock(tmp_path) as lock:
        held = json.loads((tmp_path / ".difftune.lock").read_text())
        assert held["pid"] == os.getpid() and held["host"] == socket.gethostname() and held["command"]
        assert held["started"].endswith("+00:00")
        with pytest.raises(UserError, match=f"pid {os.getpid()}"):
            OutputLock(tmp_path / ".difftune.lock").acquire()
        assert lock.held
    assert not (tmp_path / ".difftune.lock").exists()
    with pytest.raises(RuntimeError):  # released on an error too
        with output_lock(tmp_path):
            raise RuntimeError("boom")
    assert not (tmp_path / ".difftune.lock").exists()


def test_stage1_cache_lock_lives_beside_the_cache(tmp_path, tiny_repo, capsys):
    from test_bad_input import stage1_cache

    meta = make_image_dataset(tmp_path / "data", n=2)
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        (tmp_path / ".cache.difftune.lock").write_text(json.dumps({"pid": holder.pid, "host": socket.gethostname()}))
        one_line_error(capsys, cli(*base_args(meta, tmp_path / "cache", tiny_repo), "--task", "sft:data_process"),
                       f"pid {holder.pid}")
    finally:
        holder.kill()
        holder.wait()
    (tmp_path / ".cache.difftune.lock").unlink()
    stage1_cache(meta, tmp_path / "cache", tiny_repo, capsys)
    assert not (tmp_path / ".cache.difftune.lock").exists() and not (tmp_path / "cache" / ".difftune.lock").exists()


# -- SIGTERM / SIGINT: save, then exit cleanly --------------------------------------------------------------------

@pytest.mark.parametrize("signum,code", [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_saves_a_checkpoint_and_state_then_exits(tmp_path, tiny_repo, capfd, monkeypatch, signum, code):
    # before: SIGTERM killed the run without saving; Ctrl-C ended in "interrupted" with nothing saved
    from difftune.training.checkpoint import CheckpointSaver, RunHooks

    meta = make_image_dataset(tmp_path / "data", n=2)
    out = tmp_path / "out"
    after_step, write = RunHooks.after_step, CheckpointSaver.write
    handler_before = signal.getsignal(signum)

    def signalled_at_step_2(self, state, loss, lr):
        after_step(self, state, loss, lr)
        if state.step == 2:
            os.kill(os.getpid(), signum)

    def second_signal_while_saving(self, inner, state, name):
        os.kill(os.getpid(), signum)  # ignored: the save completes
        return write(self, inner, state, name)

    monkeypatch.setattr(RunHooks, "after_step", signalled_at_step_2)
    monkeypatch.setattr(CheckpointSaver, "write", second_signal_while_saving)
    rc = cli(*base_args(meta, out, tiny_repo), "--dataset_repeat", 6, "--save_state_steps", 3, "--enable_csv_log")
    err = capfd.readouterr().err.strip().splitlines()  # the notes are written to fd 2 directly
    assert rc == code, err
    name = signal.Signals(signum).name
    assert err[-1] == (f"stopped by {name} at step 2: saved {out / 'step-2.safetensors'} and the training state "
                       f"{out / 'state' / 'step-2'}; continue with --resume_from_checkpoint latest")
    assert any("received again: ignored" in line for line in err)
    assert (out / "step-2.safetensors").is_file() and (out / "state" / "step-2" / "state.json").is_file()
    assert not (out / "epoch-0.safetensors").exists()  # it really stopped
    assert [r.split(",")[0] for r in (out / "loss.csv").read_text().splitlines()[1:]] == ["1", "2"]
    assert json.loads((out / "training_args.json").read_text())["run_id"]
    assert not (out / ".difftune.lock").exists()
    assert signal.getsignal(signum) == handler_before  # restored after the run


def test_sigterm_before_training_releases_the_lock(tmp_path, tiny_repo, capsys, monkeypatch):
    import difftune.training.recipe as recipe

    meta = make_image_dataset(tmp_path / "data", n=2)
    real = recipe.setup

    def killed_while_loading(*a, **k):
        os.kill(os.getpid(), signal.SIGTERM)
        return real(*a, **k)

    monkeypatch.setattr(recipe, "setup", killed_while_loading)
    assert cli(*base_args(meta, tmp_path / "out", tiny_repo)) == 143
    assert capsys.readouterr().err.strip().splitlines()[-1] == "stopped by SIGTERM"
    assert not (tmp_path / "out" / ".difftune.lock").exists()


@pytest.mark.slow
def test_sigterm_then_resume_gives_the_same_lora(tmp_path, tiny_repo, capsys):
    from test_resume import run_in_process, train_cmd

    meta = make_image_dataset(tmp_path / "data", n=2)
    models = model_paths_json(tiny_repo)
    run_in_process(train_cmd(meta.parent, meta, models, tmp_path / "full"))
    cmd = train_cmd(meta.parent, meta, models, tmp_path / "stopped")
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    state_root = tmp_path / "stopped" / "state"
    deadline = time.time() + 300
    while not list(state_root.glob("step-*")):
        assert proc.poll() is None and time.time() < deadline, proc.stderr.read() if proc.poll() is not None else ""
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    err = proc.communicate(timeout=300)[1].strip().splitlines()
    assert proc.returncode == 143, err
    stopped_at = int(err[-1].split(" at step ")[1].split(":")[0])
    assert stopped_at < 12  # 2 epochs x 12 samples / accumulation 2
    assert (tmp_path / "stopped" / f"step-{stopped_at}.safetensors").is_file()
    assert (state_root / f"step-{stopped_at}" / "state.json").is_file()
    capsys.readouterr()
    run_in_process([*cmd, "--resume_from_checkpoint", "latest"])
    assert f"resumed from {state_root / f'step-{stopped_at}'}" in capsys.readouterr().out
    a = load_file(str(tmp_path / "full" / "epoch-1.safetensors"))
    b = load_file(str(tmp_path / "stopped" / "epoch-1.safetensors"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6
