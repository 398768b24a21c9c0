"""Full training state for exact resume, without pickle.

A state directory `<output_path>/state/step-<N>/` holds the trainable weights, the optimizer state
(tensors in safetensors, the rest in JSON), the learning-rate schedule's counters, every process's RNG
state, the data position (epoch, step inside the epoch, global step) and the settings that must not
change for the resume to be exact. It is written to a temporary directory and renamed, and only the last
`keep` states are kept, so a run killed at any moment leaves the previous states intact.

The tensors are laid out by the engine that trained (state.json's `format`):
  1  one process or DDP: `weights.safetensors`, `optimizer.safetensors`, whole, written by the main process;
  2  FSDP2: `shards/shard-<rank>-model-00001-of-00001.safetensors`, each process the shards of the weights and
     optimizer moments it holds, with their offsets in the header (torch.distributed.checkpoint's safetensors
     storage: no pickled `.metadata`); read back into any number of processes, sharded or not;
  3  DeepSpeed ZeRO: `deepspeed-<rank>.safetensors`, each process the whole fp32 weights and moments of its share
     of the parameters (`deepspeed_state.py`); read back by DeepSpeed on any number of processes.
A format-1 state also resumes under FSDP2. Another number of processes resumes exactly when processes x
--batch_size x --gradient_accumulation_steps is unchanged (every step then sees the same samples).
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
from ..util import PICKLE_SUFFIXES, first_line, names, non_finite
from .config import LIST_FLAGS
from .state_names import check_names as _check_names

STATE_DIR = "state"
FORMAT = 1  # whole tensors (one process, DDP)
SHARDED_FORMAT = 2  # FSDP2
DEEPSPEED_FORMAT = 3  # DeepSpeed ZeRO
FORMATS = {FORMAT: "one process / DDP", SHARDED_FORMAT: "FSDP2", DEEPSPEED_FORMAT: "DeepSpeed"}
SHARDS = "shards"
LAYOUT = ("world_size", "batch_size", "gradient_accumulation_steps")  # their product: the samples of one step


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


def _state_format(accelerator) -> int:
    from .engines import DEEPSPEED, FSDP, engine_of

    return {FSDP: SHARDED_FORMAT, DEEPSPEED: DEEPSPEED_FORMAT}.get(engine_of(accelerator), FORMAT)


def save_training_state(accelerator, module, optimizer, schedule, position: dict, settings: dict,
                        output_path: str | os.PathLike, keep: int = 2) -> Path | None:
    """Write state/step-<N> atomically: every process writes its RNG (and, sharded, its part of the tensors); the
    main process the rest.

    A write that fails (disk full, ...) is one UserError line naming the file; the temporary directory is
    removed and the earlier states are left as they were."""
    root = Path(output_path) / STATE_DIR
    step = position["global_step"]
    final = root / f"step-{step}"
    tmp = root / f".tmp-step-{step}"
    layout = _state_format(accelerator)
    try:
        if accelerator.is_main_process:
            if tmp.exists():
                shutil.rmtree(tmp)
            _os_step(final, lambda: tmp.mkdir(parents=True))
        accelerator.wait_for_everyone()
        rng = f"rng-{accelerator.process_index}.safetensors"
        _save_tensors({f"rank{accelerator.process_index}.{k}": v for k, v in _rng_tensors().items()}, tmp / rng,
                      final / rng)
        if layout == SHARDED_FORMAT:
            tensors_meta = _save_sharded(module, optimizer, tmp, final)
        elif layout == DEEPSPEED_FORMAT:
            from .deepspeed_state import save_deepspeed_tensors

            tensors_meta = save_deepspeed_tensors(accelerator, module, tmp, final, _save_tensors)
        else:
            tensors_meta = _save_whole(accelerator, module, optimizer, tmp, final)
        if accelerator.is_main_process:
            sched = {k: v for k, v in schedule.state_dict().items() if k != "lr_lambdas"}
            meta = {"format": layout, "position": position, "settings": settings, "schedule": sched, **tensors_meta}
            _os_step(final / "state.json", (tmp / "state.json").write_text, json.dumps(meta, indent=1, default=str))
        accelerator.wait_for_everyone()
        if accelerator.is_main_process:
            for f in tmp.rglob("*"):
                if f.is_file():
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


def _save_whole(accelerator, module, optimizer, tmp: Path, final: Path) -> dict:
    """Format 1: the main process writes the whole trainable weights and optimizer state."""
    inner = accelerator.unwrap_model(module)
    trainable = {n: p for n, p in inner.named_parameters() if p.requires_grad}
    optimizer_tensors, optimizer_meta = _optimizer_to_files(optimizer)
    if accelerator.is_main_process:
        _save_tensors({n: p.detach().cpu().contiguous() for n, p in trainable.items()},
                      tmp / "weights.safetensors", final / "weights.safetensors")
        _save_tensors(optimizer_tensors or {"_empty": torch.zeros(0)}, tmp / "optimizer.safetensors",
                      final / "optimizer.safetensors")
    return {"optimizer": optimizer_meta, "param_names": list(trainable)}


# -- format 2: sharded (FSDP2), any number of processes on reading ---------------------------------------------------

def _inner_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it


def _dcp_module(module):
    """What torch.distributed.checkpoint's state-dict functions take: the FSDP2 module itself, else the bare one."""
    from torch.distributed.fsdp import FSDPModule

    return module if isinstance(module, FSDPModule) else getattr(module, "module", module)


def _sharded_tensors(module, optimizer) -> tuple[dict, dict, list[str]]:
    """{"model": trainable weights, "optim": optimizer tensors as "<param>/<key>"} (DTensors under FSDP2: each
    process holds its shards), the optimizer's state dict (param_groups, non-tensor values) and the trainable
    parameter names."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    target = _dcp_module(module)
    names = [n for n, p in target.named_parameters() if p.requires_grad]
    options = StateDictOptions(full_state_dict=False)
    model = get_model_state_dict(target, options=options)
    model = {n: model[n] for n in names}
    optim = get_optimizer_state_dict(target, _inner_optimizer(optimizer), options=options)
    flat = {f"{name}/{key}": value for name, state in optim["state"].items() for key, value in state.items()
            if isinstance(value, torch.Tensor)}
    return {"model": model, "optim": flat}, optim, names


def _save_sharded(module, optimizer, tmp: Path, final: Path) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    tensors, optim, names = _sharded_tensors(module, optimizer)
    try:
        dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(str(tmp / SHARDS), save_distributed=True))
    except Exception as exc:
        err = os_error_of(exc)
        if err is None:
            raise
        raise write_error(final / SHARDS, err) from None
    scalars = {name: {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)}
               for name, state in optim["state"].items()}
    return {"param_names": names, "optimizer_keys": sorted(tensors["optim"]),
            "optimizer_scalars": {n: v for n, v in scalars.items() if v},
            "param_groups": [{k: v for k, v in g.items() if k != "params"} for g in optim["param_groups"]]}


def _load_sharded(path: Path, meta: dict, module, optimizer) -> None:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint import HuggingFaceStorageReader
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    tensors, optim, names = _sharded_tensors(module, optimizer)
    _check_names(path, meta["param_names"], names)
    # A parameter that never had a gradient (e.g. a branch the loss does not reach) has no optimizer state in the
    # saving run, while the template made here has one for every parameter: read only what was saved.
    saved_keys = set(meta["optimizer_keys"])
    tensors["optim"] = {k: v for k, v in tensors["optim"].items() if k in saved_keys}
    if len(tensors["optim"]) != len(saved_keys):
        raise UserError(f"{path}: the saved optimizer state does not match this run's parameters")
    try:
        dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(path / SHARDS)))
    except Exception as err:  # a shard deleted or cut: torch's error names no file
        raise UserError(f"{path / SHARDS}: the sharded training state cannot be read ({first_line(err)}); "
                        f"copy the whole state folder") from None
    check_finite_state(path / SHARDS, {**tensors["model"], **tensors["optim"]})
    target = _dcp_module(module)
    set_model_state_dict(target, tensors["model"], options=StateDictOptions(strict=False))
    with_state = {k.rpartition("/")[0] for k in saved_keys}
    scalars = meta.get("optimizer_scalars", {})
    optim["state"] = {name: {**{key: tensors["optim"][f"{name}/{key}"] for key, value in state.items()
                                if isinstance(value, torch.Tensor)}, **scalars.get(name, {})}
                      for name, state in optim["state"].items() if name in with_state}
    _restore_groups(optim["param_groups"], meta["param_groups"])
    # strict=False: the parameters left without state above
    set_optimizer_state_dict(target, _inner_optimizer(optimizer), optim,
                             options=StateDictOptions(full_state_dict=False, strict=False))


def _restore_groups(groups: list[dict], saved: list[dict]) -> None:
    for group, saved_group in zip(groups, saved):
        group.update({k: (tuple(v) if isinstance(v, list) else v) for k, v in saved_group.items() if k != "params"})


def _load_whole_into_sharded(path: Path, meta: dict, module, optimizer) -> None:
    """A format-1 state (whole tensors) into FSDP2 processes: each process takes its shards of every tensor."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                         set_model_state_dict, set_optimizer_state_dict)

    target = _dcp_module(module)
    names = [n for n, p in target.named_parameters() if p.requires_grad]
    _check_names(path, meta["param_names"], names)
    options = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(target, read_state_file(path / "weights.safetensors"), options=options)
    saved = _optimizer_from_files(read_state_file(path / "optimizer.safetensors"), meta["optimizer"])
    optim = get_optimizer_state_dict(target, _inner_optimizer(optimizer), options=options)
    # format 1 numbers the parameters in the optimizer's order, which is the trainable parameters' order
    optim["state"] = {meta["param_names"][pid]: state for pid, state in saved["state"].items()}
    _restore_groups(optim["param_groups"], saved["param_groups"])
    set_optimizer_state_dict(target, _inner_optimizer(optimizer), optim, options=options)


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


def _same(key: str, saved, value) -> bool:
    """A list flag's setting is its text ("to_q,to_k"); a state saved before the flags were parsed holds the text
    as it was given ("to_q, to_k,to_q"): the same names are the same setting."""
    if key in LIST_FLAGS and isinstance(saved, str) and isinstance(value, str):
        return names(saved) == names(value)
    return saved == value


def changed_settings(saved: dict, settings: dict) -> tuple[list[str], str | None]:
    """The settings that changed in a way that makes the resume inexact, and a note for a change of the process
    layout that keeps processes x batch x accumulation (the same samples in every step: exact)."""
    changed = [k for k in sorted(set(saved) | set(settings)) if not _same(k, saved.get(k), settings.get(k))]
    note = None
    layout = [k for k in changed if k in LAYOUT]

    def product(values):
        try:
            return int(values["world_size"]) * int(values["batch_size"]) * int(values["gradient_accumulation_steps"])
        except (KeyError, TypeError, ValueError):
            return None

    if layout and product(saved) is not None and product(saved) == product(settings):
        changed = [k for k in changed if k not in LAYOUT]
        note = (f"resuming with another layout ({', '.join(f'{k} {saved[k]} -> {settings[k]}' for k in layout)}): "
                f"{product(settings)} samples per step as before, so every step sees the same samples")
    return [f"{k} ({saved.get(k)!r} -> {settings.get(k)!r})" for k in changed], note


def load_training_state(path: Path, accelerator, module, optimizer, schedule, settings: dict,
                        force: bool = False) -> dict:
    """Restore everything saved by `save_training_state`; returns the data position."""
    from .engines import DEEPSPEED, FSDP, engine_of

    for dirpath, _, files in os.walk(path):
        for name in files:
            if name.endswith(PICKLE_SUFFIXES) or name == ".metadata":  # DCP's own index file is a pickle
                raise UserError(f"{path}: contains {name}; difftune never loads pickled files")
    meta = json.loads((path / "state.json").read_text())
    layout = meta.get("format")
    if layout not in FORMATS:
        raise UserError(f"{path}: training state format {layout} is not supported (expected one of "
                        f"{', '.join(map(str, FORMATS))})")
    engine = engine_of(accelerator)
    if (layout == DEEPSPEED_FORMAT) != (engine == DEEPSPEED):
        raise UserError(f"--resume_from_checkpoint {path}: a state saved under {FORMATS[layout]} does not resume "
                        f"under {engine}" + (" (resume it under DeepSpeed)" if layout == DEEPSPEED_FORMAT else
                                             " (resume it under FSDP2, DDP or one process)"))
    changed, note = changed_settings(meta["settings"], settings)
    if changed and not force:
        raise UserError(f"--resume_from_checkpoint {path}: these settings changed and the resume would not be exact: "
                        f"{'; '.join(changed)} (add --force_resume to continue anyway)")
    if note and accelerator.is_main_process:
        print(f"note: {note}")
    if layout == SHARDED_FORMAT:
        _load_sharded(path, meta, module, optimizer)
    elif layout == DEEPSPEED_FORMAT:
        from .deepspeed_state import load_deepspeed_tensors

        load_deepspeed_tensors(path, meta, accelerator, module)
    elif engine == FSDP:
        _load_whole_into_sharded(path, meta, module, optimizer)
    else:
        _load_whole(path, meta, accelerator, module, optimizer)
    sched_state = schedule.state_dict()
    sched_state.update(meta["schedule"])
    schedule.load_state_dict(sched_state)
    rng_file = path / f"rng-{accelerator.process_index}.safetensors"
    if rng_file.exists():  # a run with more processes than the saving one: the new ones keep their own seeding
        rng = load_file(str(rng_file))
        torch.set_rng_state(rng[f"rank{accelerator.process_index}.torch_cpu"])
        if torch.cuda.is_available() and f"rank{accelerator.process_index}.torch_cuda" in rng:
            torch.cuda.set_rng_state(rng[f"rank{accelerator.process_index}.torch_cuda"])
    return meta["position"]


def read_state_file(file: Path) -> dict[str, torch.Tensor]:
    """A state's tensors, each finite: a cut or missing file, or a NaN put there, is one line naming the file
    (NaN moments would otherwise train on and save a NaN LoRA, the loss still finite for a step or more)."""
    from safetensors import SafetensorError

    if not file.is_file():
        raise UserError(f"{file}: missing from the training state (copy the whole state folder)")
    try:
        tensors = load_file(str(file))
    except (SafetensorError, OSError) as err:
        reason = first_line(err).removeprefix("Error while deserializing header: ")
        hint = "truncated" if "not fully covered" in reason or "too small" in reason.lower() else "unreadable"
        raise UserError(f"{file}: {hint} training state file ({reason})") from None
    check_finite_state(file, tensors)
    return tensors


def check_finite_state(file, tensors: dict) -> None:
    for key, value in tensors.items():
        local = value.to_local() if hasattr(value, "to_local") else value  # a DTensor: this process's shard
        problem = non_finite(local)
        if problem:
            raise UserError(f"{file}: tensor '{key}' holds {problem}")


def _load_whole(path: Path, meta: dict, accelerator, module, optimizer) -> None:
    """Format 1 into one process or DDP."""
    inner = accelerator.unwrap_model(module)
    weights = read_state_file(path / "weights.safetensors")
    params = dict(inner.named_parameters())
    missing = [n for n in meta["param_names"] if n not in params]
    if missing:
        raise UserError(f"{path}: the saved state has parameters this run does not train, e.g. {missing[0]}")
    with torch.no_grad():
        for name, value in weights.items():
            params[name].copy_(value.to(params[name].dtype))
    optimizer.load_state_dict(_optimizer_from_files(read_state_file(path / "optimizer.safetensors"), meta["optimizer"]))
