"""Full training state for exact resume, without pickle.

A state directory `<output_path>/state/step-<N>/` holds the trainable weights, the optimizer state
(tensors in safetensors, the rest in JSON), the learning-rate schedule's counters, every process's RNG
state, the data position (epoch, step inside the epoch, global step) and the settings that must not
change for the resume to be exact. It is written to a temporary directory and renamed, and only the last
`keep` states are kept, so a run killed at any moment leaves the previous states intact.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ..errors import UserError
from ..io import normal_permissions, os_error_of, write_error
from ..util import PICKLE_SUFFIXES

STATE_DIR = "state"
FORMAT = 1


def exactness_settings(config, world_size: int, dataset_len: int) -> dict:
    """The settings that change which samples, noise or updates a step sees: resuming with other values is not
    exact. `config` is the LoopConfig; its `exactness` adds what only the caller knows (task, LoRA shape)."""
    return {"world_size": world_size, "batch_size": config.batch_size,
            "gradient_accumulation_steps": config.gradient_accumulation_steps, "dataset_len": dataset_len,
            "seed": config.seed, "learning_rate": config.learning_rate, "lr_scheduler": config.lr_scheduler,
            "lr_warmup_steps": config.lr_warmup_steps, **config.exactness}


def _optimizer_to_files(optimizer) -> tuple[dict[str, torch.Tensor], dict]:
    sd = optimizer.state_dict()
    tensors, meta = {}, {"param_groups": sd["param_groups"], "state": {}}
    for pid, state in sd["state"].items():
        entry = {}
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{pid}.{key}"] = value.detach().cpu().contiguous()
                entry[key] = {"tensor": f"{pid}.{key}"}
            else:
                entry[key] = value
        meta["state"][str(pid)] = entry
    return tensors, meta


def _optimizer_from_files(tensors: dict[str, torch.Tensor], meta: dict) -> dict:
    state = {}
    for pid, entry in meta["state"].items():
        state[int(pid)] = {k: (tensors[v["tensor"]] if isinstance(v, dict) and "tensor" in v else v)
                           for k, v in entry.items()}
    return {"state": state, "param_groups": meta["param_groups"]}


def _rng_tensors() -> dict[str, torch.Tensor]:
    out = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["torch_cuda"] = torch.cuda.get_rng_state()
    return out


def _save_tensors(tensors: dict[str, torch.Tensor], tmp_file: Path, shown: Path) -> None:
    """safetensors' `save_file`; an OS error (disk full, quota, ...) becomes one line naming `shown`."""
    try:
        save_file(tensors, str(tmp_file))
    except Exception as exc:
        err = os_error_of(exc)
        if err is None:
            raise
        raise write_error(shown, err, sum(t.numel() * t.element_size() for t in tensors.values())) from None


def _os_step(what: Path, action, *args) -> None:
    try:
        action(*args)
    except OSError as err:
        raise write_error(what, err) from None


def save_training_state(accelerator, module, optimizer, schedule, position: dict, settings: dict,
                        output_path: str | os.PathLike, keep: int = 2) -> Path | None:
    """Write state/step-<N> atomically (every process writes its RNG; the main process the rest).

    A write that fails (disk full, ...) is one UserError line naming the file; the temporary directory is
    removed and the earlier states are left as they were."""
    root = Path(output_path) / STATE_DIR
    step = position["global_step"]
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    inner = accelerator.unwrap_model(module)
    trainable = {n: p for n, p in inner.named_parameters() if p.requires_grad}
    try:
        if accelerator.is_main_process:
            if tmp.exists():
                shutil.rmtree(tmp)
            _os_step(final, lambda: tmp.mkdir(parents=True))
        accelerator.wait_for_everyone()
        rng = f"rng-{accelerator.process_index}.safetensors"
        _save_tensors({f"rank{accelerator.process_index}.{k}": v for k, v in _rng_tensors().items()}, tmp / rng,
                      final / rng)
        optimizer_tensors, optimizer_meta = _optimizer_to_files(optimizer)
        if accelerator.is_main_process:
            _save_tensors({n: p.detach().cpu().contiguous() for n, p in trainable.items()},
                          tmp / "weights.safetensors", final / "weights.safetensors")
            _save_tensors(optimizer_tensors or {"_empty": torch.zeros(0)}, tmp / "optimizer.safetensors",
                          final / "optimizer.safetensors")
            sched = {k: v for k, v in schedule.state_dict().items() if k != "lr_lambdas"}
            meta = {"format": FORMAT, "position": position, "settings": settings, "optimizer": optimizer_meta,
                    "schedule": sched, "param_names": list(trainable)}
            _os_step(final / "state.json", (tmp / "state.json").write_text, json.dumps(meta, indent=1, default=str))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            for f in tmp.iterdir():
                normal_permissions(f)
            if final.exists():
                shutil.rmtree(final)
            _os_step(final, os.replace, tmp, final)
    except BaseException:
        if accelerator.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)  # the earlier states stay as they were
        raise
    if accelerator.is_main_process:
        states = sorted(list_states(root), key=lambda p: int(p.name.split("-")[1]))
        for old in states[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def list_states(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return [p for p in root.iterdir() if p.is_dir() and p.name.startswith("step-") and (p / "state.json").exists()]


def find_state(spec: str, output_path: str | os.PathLike) -> Path:
    """`latest` (the newest state under <output_path>/state) or a state directory."""
    if spec == "latest":
        states = sorted(list_states(Path(output_path) / STATE_DIR), key=lambda p: int(p.name.split("-")[1]))
        if not states:
            raise UserError(f"--resume_from_checkpoint latest: no saved training state under {output_path}/{STATE_DIR} "
                            f"(save one with --save_state_steps N)")
        return states[-1]
    path = Path(spec)
    if not (path / "state.json").is_file():
        raise UserError(f"--resume_from_checkpoint {spec}: not a training state directory (no state.json)")
    return path


def load_training_state(path: Path, accelerator, module, optimizer, schedule, settings: dict,
                        force: bool = False) -> dict:
    """Restore everything saved by `save_training_state`; returns the data position."""
    for name in os.listdir(path):
        if name.endswith(PICKLE_SUFFIXES):
            raise UserError(f"{path}: contains {name}; difftune never loads pickled files")
    meta = json.loads((path / "state.json").read_text())
    if meta.get("format") != FORMAT:
        raise UserError(f"{path}: training state format {meta.get('format')} is not supported (expected {FORMAT})")
    saved = meta["settings"]
    changed = [f"{k} ({saved.get(k)!r} -> {settings.get(k)!r})" for k in sorted(set(saved) | set(settings))
               if saved.get(k) != settings.get(k)]
    if changed and not force:
        raise UserError(f"--resume_from_checkpoint {path}: these settings changed and the resume would not be exact: "
                        f"{'; '.join(changed)} (add --force_resume to continue anyway)")
    inner = accelerator.unwrap_model(module)
    weights = load_file(str(path / "weights.safetensors"))
    params = dict(inner.named_parameters())
    missing = [n for n in meta["param_names"] if n not in params]
    if missing:
        raise UserError(f"{path}: the saved state has parameters this run does not train, e.g. {missing[0]}")
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value.to(params[name].dtype))
    optimizer.load_state_dict(_optimizer_from_files(load_file(str(path / "optimizer.safetensors")), meta["optimizer"]))
    sched_state = schedule.state_dict()
    sched_state.update(meta["schedule"])
    schedule.load_state_dict(sched_state)
    rng_file = path / f"rng-{accelerator.process_index}.safetensors"
    if rng_file.exists():
        rng = load_file(str(rng_file))
        torch.set_rng_state(rng[f"rank{accelerator.process_index}.torch_cpu"])
        if torch.cuda.is_available() and f"rank{accelerator.process_index}.torch_cuda" in rng:
            torch.cuda.set_rng_state(rng[f"rank{accelerator.process_index}.torch_cuda"])
    return meta["position"]
