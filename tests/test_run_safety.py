"""Nothing of an earlier run is lost: a failing state write, a failing run, two runs into one folder, and a
run stopped by SIGTERM / Ctrl-C (it saves, then exits cleanly)."""

import errno

import pytest

from conftest import make_image_dataset
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
    earlier = tree(out / "state")
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
