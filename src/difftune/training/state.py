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
        states = list_states(root)
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
    shard_files = sorted(f.name for f in (tmp / SHARDS).glob("*.safetensors")) if (tmp / SHARDS).is_dir() else []
    return {"param_names": names, "optimizer_keys": sorted(tensors["optim"]), "shard_files": shard_files,
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
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(path / SHARDS)))
    except (Exception, CheckpointException) as err:  # a shard deleted or cut: torch's error names no file
        # (CheckpointException is a BaseException: what dcp raises for any process's failure)
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


def state_step(path: Path) -> int | None:
    """N of a `step-<N>` folder; None for any other name (`step--4`, `step-x`: no state of ours)."""
    number = path.name[len("step-"):] if path.name.startswith("step-") else ""
    return int(number) if number.isascii() and number.isdigit() else None


def list_states(root: Path) -> list[Path]:
    """The saved states under `root`, oldest first."""
    if not root.is_dir():
        return []
    found = [p for p in root.iterdir() if p.is_dir() and state_step(p) is not None and (p / "state.json").exists()]
    return sorted(found, key=state_step)


def find_state(spec: str, output_path: str | os.PathLike) -> Path:
    """`latest` (the newest state under <output_path>/state) or a state directory."""
    if spec == "latest":
        states = list_states(Path(output_path) / STATE_DIR)
        if not states:
            raise UserError(f"--resume_from_checkpoint latest: no saved training state under {output_path}/{STATE_DIR} "
                            f"(save one with --save_state_steps N)")
        check_state(states[-1])
        return states[-1]
    path = Path(spec)
    if not (path / "state.json").is_file():
        raise UserError(f"--resume_from_checkpoint {spec}: not a training state directory (no state.json)")
    check_state(path)
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


def check_settings(path, saved: dict, settings: dict, force: bool) -> str | None:
    """Refuse a resume that would not be exact (unless `force`); the note for a changed but equivalent layout."""
    changed, note = changed_settings(saved, settings)
    if changed and not force:
        raise UserError(f"--resume_from_checkpoint {path}: these settings changed and the resume would not be exact: "
                        f"{'; '.join(changed)} (add --force_resume to continue anyway)")
    return note


def load_training_state(path: Path, accelerator, module, optimizer, schedule, settings: dict,
                        force: bool = False) -> dict:
    """Restore everything saved by `save_training_state`; returns the data position."""
    from .engines import DEEPSPEED, FSDP, engine_of

    path = Path(path)
    _no_pickles(path)
    layout = _read_format(path)[1]
    engine = engine_of(accelerator)
    if (layout == DEEPSPEED_FORMAT) != (engine == DEEPSPEED):
        raise UserError(f"--resume_from_checkpoint {path}: a state saved under {FORMATS[layout]} does not resume "
                        f"under {engine}" + (" (resume it under DeepSpeed)" if layout == DEEPSPEED_FORMAT else
                                             " (resume it under FSDP2, DDP or one process)"))
    meta = check_state(path)
    note = check_settings(path, meta["settings"], settings, force)
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
        rng = _read_rng(rng_file, accelerator.process_index)
        torch.set_rng_state(rng["torch_cpu"])
        if torch.cuda.is_available() and "torch_cuda" in rng:
            try:
                torch.cuda.set_rng_state(rng["torch_cuda"])
            except RuntimeError as err:
                raise UserError(f"{rng_file}: 'rank{accelerator.process_index}.torch_cuda' is not a random generator "
                                f"state ({first_line(err)})") from None
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
        hint = _hint(reason)
        raise UserError(f"{file}: {hint} training state file ({reason})") from None
    check_finite_state(file, tensors)
    return tensors


def _hint(reason: str) -> str:
    """safetensors' words for a file that ends too early (cut in its tensors or in its header), and for the rest."""
    cut = ("not fully covered", "too small", "invalid header length")
    return "truncated" if any(c in reason.lower() for c in cut) else "unreadable"


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


# -- the checks made before anything is loaded or written -----------------------------------------------------------

POSITION = ("global_step", "epoch", "step_in_epoch")


def _count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _no_pickles(path: Path) -> None:
    for _, _, files in os.walk(path):
        for name in files:
            if name.endswith(PICKLE_SUFFIXES) or name == ".metadata":  # DCP's own index file is a pickle
                raise UserError(f"{path}: contains {name}; difftune never loads pickled files")


def _read_format(path: Path) -> tuple[dict, int]:
    """state.json as an object, and its format; a truncated or foreign file is one line naming it."""
    file = path / "state.json"
    try:
        meta = json.loads(file.read_text(encoding="utf-8"))
    except (ValueError, UnicodeDecodeError) as err:
        raise UserError(f"{file}: not a readable training state (truncated or not JSON: {first_line(err)}); copy "
                        f"the whole state folder") from None
    except OSError as err:
        raise UserError(f"{file}: cannot be read ({first_line(err)})") from None

    if not isinstance(meta, dict):
        raise UserError(f"{file}: not a training state (a JSON {type(meta).__name__}, not an object)")
    layout = meta.get("format")
    if layout not in FORMATS or isinstance(layout, bool):
        raise UserError(f"{path}: training state format {layout} is not supported (expected one of "
                        f"{', '.join(map(str, FORMATS))})")
    return meta, layout


def read_meta(path: Path) -> dict:
    """state.json, parsed and checked for what a resume reads from it; a truncated, hand-edited or foreign file is
    one line naming it."""
    path = Path(path)
    file = path / "state.json"
    meta, layout = _read_format(path)

    def need(ok: bool, what: str) -> None:
        if not ok:
            raise UserError(f"{file}: {what} (not a state difftune wrote, or edited by hand)")

    for key in ("position", "settings", "schedule"):
        need(isinstance(meta.get(key), dict), f"'{key}' is missing or not an object")
    for key in POSITION:
        value = meta["position"].get(key)
        need(_count(value), f"position '{key}' is {json.dumps(value)}, not a whole number 0 or more")
    need(isinstance(meta.get("param_names"), list) and all(isinstance(n, str) for n in meta["param_names"]),
         "'param_names' is missing or not a list of names")
    world = meta["settings"].get("world_size", 1)
    need(_count(world) and world >= 1, f"settings 'world_size' is {json.dumps(world)}, not a number of processes")
    if layout == FORMAT:
        optimizer = meta.get("optimizer")
        need(isinstance(optimizer, dict) and isinstance(optimizer.get("state"), dict)
             and isinstance(optimizer.get("param_groups"), list), "'optimizer' is missing or not an optimizer state")
        for pid, entry in optimizer["state"].items():
            need(pid.isdigit() and int(pid) < len(meta["param_names"]) and isinstance(entry, dict),
                 f"optimizer state '{pid}' names no saved parameter")
    else:
        need(isinstance(meta.get("optimizer_keys"), list) and all(isinstance(k, str) for k in meta["optimizer_keys"]),
             "'optimizer_keys' is missing or not a list of names")
    if layout == SHARDED_FORMAT:
        need(isinstance(meta.get("param_groups"), list), "'param_groups' is missing or not a list")
    if layout == DEEPSPEED_FORMAT:
        need(_count(meta.get("parts")) and meta["parts"] >= 1, "'parts' is missing or not a number of processes")
    return meta


def _open_tensors(file: Path):
    """The safetensors file's header (each tensor's shape, nothing read): a missing, cut or foreign file is one
    line naming it."""
    from safetensors import SafetensorError, safe_open

    if not file.is_file():
        raise UserError(f"{file}: missing from the training state (copy the whole state folder)")
    try:
        return safe_open(str(file), framework="pt")
    except (SafetensorError, OSError) as err:
        reason = first_line(err).removeprefix("Error while deserializing header: ")
        hint = _hint(reason)
        raise UserError(f"{file}: {hint} training state file ({reason}); copy the whole state folder") from None


def _read_rng(file: Path, rank: int) -> dict[str, torch.Tensor]:
    """rng-<rank>.safetensors: the generator states of one process, each one torch takes back."""
    from safetensors import SafetensorError

    with_prefix = f"rank{rank}."
    try:
        rng = load_file(str(file)) if file.is_file() else None
    except (SafetensorError, OSError) as err:
        reason = first_line(err).removeprefix("Error while deserializing header: ")
        raise UserError(f"{file}: unreadable training state file ({reason}); copy the whole state folder") from None
    if rng is None:
        raise UserError(f"{file}: missing from the training state (copy the whole state folder)")
    cpu = rng.get(f"{with_prefix}torch_cpu")
    current = torch.get_rng_state()
    bad = None
    if cpu is None:
        bad = f"has no '{with_prefix}torch_cpu'"
    elif cpu.dtype != torch.uint8 or cpu.shape != current.shape:
        bad = (f"'{with_prefix}torch_cpu' is not a random generator state ({cpu.dtype}, shape {list(cpu.shape)}; "
               f"torch's is uint8, {list(current.shape)})")
    else:
        try:
            torch.set_rng_state(cpu)  # torch checks the state's inner consistency; put back just below
        except RuntimeError as err:
            bad = f"'{with_prefix}torch_cpu' is not a random generator state ({first_line(err)})"
        finally:
            torch.set_rng_state(current)
    cuda = rng.get(f"{with_prefix}torch_cuda")
    if bad is None and cuda is not None and (cuda.dtype != torch.uint8 or cuda.dim() != 1):
        bad = f"'{with_prefix}torch_cuda' is not a random generator state ({cuda.dtype}, shape {list(cuda.shape)})"
    if bad:
        raise UserError(f"{file}: {bad}")
    return {k[len(with_prefix):]: v for k, v in rng.items() if k.startswith(with_prefix)}


def _shard_files(path: Path, meta: dict) -> list[Path]:
    recorded = meta.get("shard_files")
    if isinstance(recorded, list) and recorded and all(isinstance(n, str) and "/" not in n for n in recorded):
        return [path / SHARDS / n for n in recorded]
    # a state saved before the list was recorded: one file per saving process, numbered from 1
    files = []
    for i in range(1, int(meta["settings"].get("world_size", 1)) + 1):
        found = sorted((path / SHARDS).glob(f"shard-{i:05d}-*.safetensors"))
        files.append(found[0] if found else path / SHARDS / f"shard-{i:05d}-model-00001-of-00001.safetensors")
    return files


def check_state(path: Path) -> dict:
    """Everything about a state folder that needs no model, checked before a run loads or writes anything: no
    pickles, a sound state.json, every file it needs present and whole (headers), every RNG state one torch takes.
    Returns state.json's contents."""
    path = Path(path)
    _no_pickles(path)
    meta = read_meta(path)
    layout = meta["format"]
    if layout == FORMAT:
        files = [path / "weights.safetensors", path / "optimizer.safetensors"]
    elif layout == SHARDED_FORMAT:
        files = _shard_files(path, meta)
    else:
        from .deepspeed_state import part_name

        files = [path / part_name(rank) for rank in range(meta["parts"])]
    for file in files:
        _open_tensors(file)
    for rank in range(int(meta["settings"].get("world_size", 1))):
        _read_rng(path / f"rng-{rank}.safetensors", rank)
    return meta


def _shape(shape) -> str:
    return f"[{', '.join(str(d) for d in shape)}]"


def check_state_fits(path: Path, module, plain_optimizer: bool = True) -> None:
    """A whole-tensor state (format 1) against the module about to train, before anything is written: the same
    trained parameters, each weight of its parameter's shape and, for torch's own optimizers (`plain_optimizer`),
    each optimizer tensor too (a cut tensor is otherwise copied by broadcasting, or its step fails much later)."""
    meta = read_meta(Path(path))
    if meta["format"] != FORMAT:
        return  # the sharded formats' readers compare every shard with the run's tensors
    params = {n: p for n, p in module.named_parameters() if p.requires_grad}
    _check_names(path, meta["param_names"], list(params))
    weights_file = Path(path) / "weights.safetensors"
    with _open_tensors(weights_file) as f:
        saved = {k: f.get_slice(k).get_shape() for k in f.keys()}
    for name in meta["param_names"]:
        if name not in saved:
            raise UserError(f"{weights_file}: tensor '{name}' is missing (copy the whole state folder)")
        if list(saved[name]) != list(params[name].shape):
            raise UserError(f"{weights_file}: tensor '{name}' has shape {_shape(saved[name])}, the parameter it "
                            f"restores {_shape(params[name].shape)}")
    optimizer_file = Path(path) / "optimizer.safetensors"
    with _open_tensors(optimizer_file) as f:
        saved = {k: f.get_slice(k).get_shape() for k in f.keys()}
    for pid, entry in meta["optimizer"]["state"].items():
        name = meta["param_names"][int(pid)]
        for value in entry.values():
            if not (isinstance(value, dict) and "tensor" in value):
                continue
            key = value["tensor"]
            if key not in saved:
                raise UserError(f"{optimizer_file}: tensor '{key}' is missing (copy the whole state folder)")
            if plain_optimizer and len(saved[key]) > 0 and list(saved[key]) != list(params[name].shape):
                raise UserError(f"{optimizer_file}: tensor '{key}' has shape {_shape(saved[key])}, its parameter "
                                f"{name} {_shape(params[name].shape)}")
