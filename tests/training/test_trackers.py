"""Issue 25 item 14: --enable_wandb_log / --enable_swanlab_log (the reference's flags) through accelerate's trackers.
A tiny run logs to W&B in its offline mode and to SwanLab in its local mode; what they wrote is read back from their
files: every step's loss and learning rate (equal to loss.csv), the flags as the run's config, and the validation
renders (an image grid; for a video family also the clip). W&B writes nothing outside the run's output folder, and
a tracker folder that is a file is one line."""

from __future__ import annotations

import csv
import glob
import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from difftune.errors import UserError
from support import tiny_family

pytestmark = pytest.mark.slow


def cli(*argv):
    from difftune.cli.main import main

    return main(["train", *[str(a) for a in argv]])


def wandb_records(run_dir: Path):
    """The records of a W&B run file (`run-<id>.wandb`: a LevelDB-style log of protobuf `Record`s)."""
    from wandb.proto import wandb_internal_pb2 as pb

    (path,) = glob.glob(str(run_dir / "run-*.wandb"))
    data = Path(path).read_bytes()
    assert data[:4] == b":W&B"
    pos, block, chunks, pending = 7, 32768, [], b""
    while pos + 7 <= len(data):
        left = block - pos % block
        if left < 7:  # a block's tail too short for a header is padding
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        if length == 0 and kind == 0:
            pos += left
            continue
        chunk, pos = data[pos + 7:pos + 7 + length], pos + 7 + length
        if kind == 1:
            chunks.append(chunk)
        elif kind in (2, 3):
            pending += chunk
        elif kind == 4:
            chunks.append(pending + chunk)
            pending = b""
    for raw in chunks:
        record = pb.Record()
        record.ParseFromString(raw)
        yield record


def csv_rows(out: Path) -> list[dict]:
    with open(out / "loss.csv") as f:
        return list(csv.DictReader(f))


@pytest.fixture(params=["qwen_image", "wan"])
def run(request, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    pytest.importorskip("swanlab")
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    monkeypatch.setenv("SWANLAB_MODE", "local")
    t = tiny_family(request.param, tmp_path / "models")
    meta = t.write_dataset(tmp_path / "data")
    out = tmp_path / "out"
    code = cli("--task", "sft", "--family", request.param, "--dataset_base_path", meta.parent,
               "--dataset_metadata_path", meta, "--output_path", out, "--model_paths", json.dumps(t.model_paths),
               "--torch_dtype", "float32", "--learning_rate", 1e-3, "--max_steps", 2, "--seed", 5, "--no_progress",
               "--enable_tensorboard_log", "false", "--enable_csv_log", *t.flags, "--lora_base_model", "dit",
               "--lora_target_modules", t.lora_target_modules, "--lora_rank", 2, "--validation_prompts", "a red circle",
               "--validation_steps", 1, "--validation_size", 32, "--validation_inference_steps", 1,
               *(["--validation_num_frames", 5] if request.param == "wan" else []),
               "--enable_wandb_log", "--wandb_project", "trust-test", "--enable_swanlab_log")
    assert code == 0
    return request.param, out


def test_wandb_offline_run_holds_the_loss_lr_config_and_validation(run):
    family, out = run
    (run_dir,) = [Path(p) for p in glob.glob(str(out / "wandb_log" / "wandb" / "offline-run-*"))]
    history, config = [], {}
    for record in wandb_records(run_dir):
        kind = record.WhichOneof("record_type")
        if kind == "history":
            history.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item})
        elif kind == "run":
            config.update({i.key: json.loads(i.value_json) for i in record.run.config.update})
        elif kind == "config":
            config.update({i.key: json.loads(i.value_json) for i in record.config.update})
    rows = csv_rows(out)
    logged = {int(h["_step"]): h for h in history}
    for row in rows:  # every optimizer step's loss and learning rate, as loss.csv has them
        step = int(row["step"])
        assert logged[step]["train/loss"] == pytest.approx(float(row["loss"]), rel=1e-6)
        assert logged[step]["train/lr"] == pytest.approx(float(row["lr"]), rel=1e-6)
    flags = config.get("learning_rate", {})
    assert (flags.get("value") if isinstance(flags, dict) else flags) == pytest.approx(1e-3)
    images = [h["validation"] for h in history if "validation" in h] or \
        [{"path": h["validation/path"]} for h in history if "validation/path" in h]
    assert len(images) == 2  # steps 1 and 2
    assert all((run_dir / "files" / i["path"]).is_file() for i in images)
    if family == "wan":
        clips = [h for h in history if "validation_clip/path" in h or "validation_clip" in h]
        assert len(clips) == 2
        path = clips[0].get("validation_clip/path") or clips[0]["validation_clip"]["path"]
        assert (run_dir / "files" / path).is_file() and path.endswith(".gif")


def test_swanlab_local_run_holds_the_loss_lr_config_and_validation(run):
    family, out = run
    (run_dir,) = [Path(p) for p in glob.glob(str(out / "swanlab_log" / "run-*"))]
    series = {}
    for log in sorted(run_dir.glob("logs/*/*.log")):
        series[log.parent.name] = [json.loads(line) for line in log.read_text().splitlines() if line.strip()]
    rows = csv_rows(out)
    losses = [pytest.approx(float(r["loss"]), rel=1e-6) for r in rows]
    rates = [pytest.approx(float(r["lr"]), rel=1e-6) for r in rows]
    values = {k: [e["data"] for e in v] for k, v in series.items()}
    assert losses in values.values()  # a series holds every step's loss
    assert rates in values.values()
    media = [v for v in series.values() if v and isinstance(v[0]["data"], list)]
    files = [name for s in media for e in s for name in e["data"]]
    assert len(files) >= (4 if family == "wan" else 2)  # the grid at steps 1 and 2 (and the clip)
    assert all(list(run_dir.glob(f"media/*/{name}")) for name in files)
    if family == "wan":
        assert any(name.endswith(".gif") for name in files)
    assert "learning_rate" in (run_dir / "files" / "config.yaml").read_text()


def test_a_missing_tracker_package_is_one_line_naming_the_extra(tmp_path, monkeypatch, capsys):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "swanlab" else real(name, *a))
    t = tiny_family("qwen_image", tmp_path / "models")
    meta = t.write_dataset(tmp_path / "data")
    code = cli("--task", "sft", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--output_path",
               tmp_path / "out", "--model_paths", json.dumps(t.model_paths), "--lora_base_model", "dit",
               "--enable_swanlab_log")
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "--enable_swanlab_log" in err[0] and "pip install 'difftune[swanlab]'" in err[0]


def test_a_service_that_does_not_start_is_one_line(tmp_path, monkeypatch, capsys):
    """W&B online without a login (no API key, no terminal to ask for one): a one-line error naming the flag and the
    offline mode, not the service's traceback or a prompt."""
    from accelerate.tracking import WandBTracker

    def refuse(self):
        raise RuntimeError("No API key configured. Use `wandb login` to log in.")

    monkeypatch.setattr(WandBTracker, "start", refuse)  # what wandb raises without a key, without the network
    from difftune.training.trackers import start

    class Accel:
        is_main_process = True
        trackers = []

    class Config:
        enable_wandb_log, enable_swanlab_log, wandb_project, output_path = True, False, "p", str(tmp_path / "out")

        def record(self):
            return {}

    from difftune.errors import UserError

    with pytest.raises(UserError) as err:
        start(Accel(), Config(), "run")
    line = str(err.value)
    assert "\n" not in line and line.startswith("--enable_wandb_log: wandb did not start (") and "No API key" in line
    assert "WANDB_MODE=offline" in line


_TRACKER_RUN = '''
import sys
from pathlib import Path
from PIL import Image
from accelerate import PartialState
from difftune.training.trackers import log_media, start

PartialState()

class Accel:
    is_main_process = True
    trackers = []

class Config:
    enable_wandb_log, enable_swanlab_log, wandb_project, output_path = True, False, "p", sys.argv[1]

    def record(self):
        return {"lr": 1.0}

accel = Accel()
start(accel, Config(), "run")
accel.trackers[0].log({"loss": 0.5}, step=1)
log_media(accel, Image.new("RGB", (16, 16), (200, 10, 10)), 1)
accel.trackers[0].finish()
'''


def _tracker_env(home):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "XDG_"))}
    env.update(HOME=str(home), WANDB_MODE="offline", WANDB_SILENT="true")
    return env


def test_wandb_offline_writes_only_under_the_output_folder(tmp_path):
    """W&B offline also wrote under ~/.cache/wandb (and its settings under ~/.config/wandb): with HOME a fresh
    folder, nothing of W&B's lands there; the run's files are under <output_path>/wandb_log."""
    pytest.importorskip("wandb")
    home, out = tmp_path / "home", tmp_path / "out"
    home.mkdir()
    proc = subprocess.run([sys.executable, "-c", _TRACKER_RUN, str(out)], env=_tracker_env(home), cwd=tmp_path,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    written = sorted(str(p.relative_to(home)) for p in home.rglob("*") if "wandb" in str(p).lower())
    assert written == []
    assert list((out / "wandb_log").rglob("run-*.wandb"))
    assert not (tmp_path / "wandb").exists() and not (tmp_path / "artifacts").exists()


def test_tracker_folder_that_is_a_file_is_one_line(tmp_path):
    from difftune.training.trackers import start

    class Accel:
        is_main_process = True
        trackers = []

    class Config:
        enable_wandb_log, enable_swanlab_log, wandb_project, output_path = True, False, "p", str(tmp_path / "out")

        def record(self):
            return {}

    pytest.importorskip("wandb")
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "wandb_log").write_text("not a folder")
    with pytest.raises(UserError) as err:
        start(Accel(), Config(), "run")
    assert str(err.value) == (f"--enable_wandb_log: {tmp_path / 'out' / 'wandb_log'} is a file, not a folder; "
                              f"move it or choose another --output_path")
