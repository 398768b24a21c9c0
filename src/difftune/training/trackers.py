"""Weights & Biases and SwanLab, the reference's `--enable_wandb_log` / `--enable_swanlab_log`, through accelerate's
trackers beside TensorBoard: the loss and learning rate of every optimizer step, the run's flags as the run's config,
and each validation render (the image grid; for clips also the animation). Files go where the reference puts them,
`<output_path>/wandb_log/` and `<output_path>/swanlab_log/` (W&B's own cache, settings and staging folders too,
unless WANDB_CACHE_DIR etc. name others); the services' own settings apply as usual
(`WANDB_MODE=offline`, `SWANLAB_MODE=local`, a login). Each is an optional extra: `pip install 'difftune[wandb]'`,
`'difftune[swanlab]'`."""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from ..errors import UserError

SERVICES = ("wandb", "swanlab")
DEFAULT_PROJECT = "difftune"


def requested(config) -> list[str]:
    """The services the flags turn on, each checked to be installed (a one-line error naming the extra if not)."""
    wanted = [name for name in SERVICES if getattr(config, f"enable_{name}_log", False)]
    for name in wanted:
        if importlib.util.find_spec(name) is None:
            raise UserError(f"--enable_{name}_log: the {name} package is not installed; "
                            f"pip install 'difftune[{name}]'")
    return wanted


def project_of(config, name: str) -> str:
    """--<service>_project, else the service's own environment variable (as the reference reads it), else ours."""
    return getattr(config, f"{name}_project", None) or os.environ.get(f"{name.upper()}_PROJECT") or DEFAULT_PROJECT


# W&B's own folders (its media cache, settings, staging, debug logs) default to ~/.cache, ~/.config and
# ~/.local/share; a variable the user set wins
_WANDB_FOLDERS = {"WANDB_CACHE_DIR": "cache", "WANDB_CONFIG_DIR": "config", "WANDB_DATA_DIR": "data",
                  "WANDB_ARTIFACT_DIR": "artifacts"}


_SET_HERE: dict[str, str] = {}  # the values this process set (a later run in the process moves them to its folder)


def _keep_wandb_in(folder: Path) -> None:
    for variable, sub in _WANDB_FOLDERS.items():
        if os.environ.get(variable, _SET_HERE.get(variable)) == _SET_HERE.get(variable):
            os.environ[variable] = _SET_HERE[variable] = str(folder / sub)


def start(accelerator, config, run_id: str) -> None:
    """On the main process: one tracker per service the flags turn on, named by the run's id, its config the flags."""
    wanted = requested(config)
    if not wanted or not accelerator.is_main_process:
        return
    from accelerate.tracking import SwanLabTracker, WandBTracker

    values = json.loads(json.dumps(config.record(), default=str))
    out = Path(config.output_path)
    for name in wanted:
        folder = out / f"{name}_log"
        if folder.exists() and not folder.is_dir():
            raise UserError(f"--enable_{name}_log: {folder} is a file, not a folder; move it or choose another "
                            f"--output_path")
        folder.mkdir(parents=True, exist_ok=True)
        if name == "wandb":
            _keep_wandb_in(folder)
            tracker = WandBTracker(project_of(config, name), name=run_id, dir=str(folder))
        else:
            tracker = SwanLabTracker(project_of(config, name), experiment_name=run_id, logdir=str(folder))
        try:
            tracker.start()
        except Exception as err:  # no login / API key, a login prompt without a terminal, the service unreachable
            from ..util import first_line

            offline = "WANDB_MODE=offline" if name == "wandb" else "SWANLAB_MODE=local"
            raise UserError(f"--enable_{name}_log: {name} did not start ({first_line(err)}); log in to {name}, "
                            f"or set {offline} to keep the run's logs on this machine") from err
        tracker.store_init_configuration(values)
        accelerator.trackers.append(tracker)


def log_media(accelerator, grid, step: int, media=None) -> None:
    """A validation render to every tracker that takes media: the grid to all; a clip's animation (a .gif path) to
    W&B and SwanLab; audio (`core.target.AudioFiles`, or a list of media) to all three, each prompt's as its own
    entry."""
    import numpy as np

    parts = media if isinstance(media, (list, tuple)) else [media] if media is not None else []
    animations = [m for m in parts if isinstance(m, (str, Path))]
    audio = [(i, p, m.sample_rate) for m in parts if hasattr(m, "sample_rate") for i, p in enumerate(m.paths)]
    for tracker in list(getattr(accelerator, "trackers", []) or []):
        if tracker.name == "tensorboard":
            tracker.writer.add_image("validation", np.asarray(grid), step, dataformats="HWC")
            for i, path, rate in audio:
                tracker.writer.add_audio(f"validation_audio/{i}", _mono(path, rate), step, sample_rate=rate)
        elif tracker.name in ("wandb", "swanlab"):
            lib = __import__(tracker.name)
            entries = {"validation": lib.Image(grid)}
            for animation in animations:
                entries["validation_clip"] = lib.Video(str(animation), **({"format": "gif"} if tracker.name == "wandb"
                                                                             else {}))
            for i, path, rate in audio:
                entries[f"validation_audio_{i}"] = lib.Audio(str(path), sample_rate=rate)
            tracker.log(entries, step=step)


def _mono(path, rate: int):
    """An audio file as TensorBoard takes it: one channel, float in [-1, 1], shape (1, samples)."""
    import torch

    from ..media.audio import read_audio

    return torch.from_numpy(read_audio(path, rate, mono=True)).reshape(1, -1)


__all__ = ["SERVICES", "log_media", "project_of", "requested", "start"]
