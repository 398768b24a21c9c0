"""Prototype (issue 26, phase 1): a sharded training state, pickle-free, that any process count can resume.

accelerate's `save_state` under FSDP2 writes torch.distributed.checkpoint's default layout: `.distcp` files and a
`.metadata` file that `load_state` reads with `pickle.load` (and RNG/scheduler files read with torch.load), which
difftune may not do with a folder a user hands it. This keeps difftune's state layout and replaces the two files
that held whole tensors by torch.distributed.checkpoint (DCP) with its safetensors storage
(`HuggingFaceStorageWriter(save_distributed=True)`): every process writes the shards it holds, with their offsets
in the safetensors header, and `HuggingFaceStorageReader` rebuilds the index from those headers, so a state
saved by N processes loads into M processes (DCP reshards) or into one unsharded process.

    state/step-<N>/
        state.json                      position, settings, schedule, optimizer param_groups, engine, world size
        shards/shard-0000R-model-00001-of-00001.safetensors   rank R-1's trainable weights + AdamW moments
        rng-<rank>.safetensors          each process's RNG
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                     get_optimizer_state_dict, set_model_state_dict,
                                                     set_optimizer_state_dict)

from difftune.errors import UserError
from difftune.util import PICKLE_SUFFIXES

FORMAT = 2  # state.py's FORMAT 1 holds whole tensors written by the main process
SHARDS = "shards"


def _inner_optimizer(optimizer):
    return getattr(optimizer, "optimizer", optimizer)  # accelerate's AcceleratedOptimizer wraps it


def _trainable_names(module) -> list[str]:
    return [n for n, p in module.named_parameters() if p.requires_grad]


def _tensors(module, optimizer) -> tuple[dict, dict, list]:
    """{"model": trainable weights, "optim": optimizer tensors} keyed by parameter name (DTensors under FSDP2:
    each process holds its shard), and the optimizer's param_groups (no tensors, for JSON)."""
    names = _trainable_names(module)
    options = StateDictOptions(full_state_dict=False)
    model = get_model_state_dict(module, options=options)
    model = {n: model[n] for n in names}
    optim = get_optimizer_state_dict(module, _inner_optimizer(optimizer), options=options)  # fills empty moments
    flat = {f"{name}/{key}": value for name, state in optim["state"].items() for key, value in state.items()
            if isinstance(value, torch.Tensor)}
    return {"model": model, "optim": flat}, optim, names


def save_sharded_state(accelerator, module, optimizer, schedule, position: dict, settings: dict,
                       output_path, keep: int = 2) -> Path:
    from torch.distributed.checkpoint import HuggingFaceStorageWriter

    root = Path(output_path) / "state"
    step = position["global_step"]
    final, tmp = root / f"step-{step}", root / f".tmp-step-{step}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        (tmp / SHARDS).mkdir(parents=True)
    accelerator.wait_for_everyone()
    tensors, optim, names = _tensors(module, optimizer)
    dcp.save(tensors, storage_writer=HuggingFaceStorageWriter(str(tmp / SHARDS), save_distributed=True))
    rank = accelerator.process_index
    save_file({k: v for k, v in _rng().items()}, str(tmp / f"rng-{rank}.safetensors"))
    if accelerator.is_main_process:
        groups = [{k: v for k, v in g.items()} for g in optim["param_groups"]]
        sched = {k: v for k, v in schedule.state_dict().items() if k != "lr_lambdas"}
        meta = {"format": FORMAT, "engine": engine_name(accelerator), "world_size": accelerator.num_processes,
                "position": position, "settings": settings, "schedule": sched, "param_groups": groups,
                "param_names": names, "optimizer_keys": sorted(tensors["optim"])}
        (tmp / "state.json").write_text(json.dumps(meta, indent=1, default=str))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if final.exists():
            shutil.rmtree(final)
        os.replace(tmp, final)
        states = sorted((p for p in root.iterdir() if p.name.startswith("step-") and (p / "state.json").exists()),
                        key=lambda p: int(p.name.split("-")[1]))
        for old in states[:-keep] if keep > 0 else []:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def engine_name(accelerator) -> str:
    return "fsdp2" if getattr(accelerator, "is_fsdp2", False) else "unsharded"


def is_sharded_state(path) -> bool:
    try:
        return json.loads((Path(path) / "state.json").read_text()).get("format") == FORMAT
    except (OSError, ValueError):
        return False


def load_sharded_state(path, accelerator, module, optimizer, schedule, settings: dict, force: bool = False) -> dict:
    """Everything `save_sharded_state` wrote, into this run's module (sharded or not, any process count)."""
    from torch.distributed.checkpoint import HuggingFaceStorageReader

    path = Path(path)
    for dirpath, _, files in os.walk(path):
        for name in files:
            if name.endswith(PICKLE_SUFFIXES) or name == ".metadata":
                raise UserError(f"{path}: contains {name}; difftune never loads pickled files")
    meta = json.loads((path / "state.json").read_text())
    saved = meta["settings"]
    changed = [f"{k} ({saved.get(k)!r} -> {settings.get(k)!r})" for k in sorted(set(saved) | set(settings))
               if saved.get(k) != settings.get(k)]
    if changed and not force:
        raise UserError(f"--resume_from_checkpoint {path}: these settings changed and the resume would not be exact: "
                        f"{'; '.join(changed)} (add --force_resume to continue anyway)")
    tensors, optim, names = _tensors(module, optimizer)
    missing = [n for n in meta["param_names"] if n not in tensors["model"]]
    if missing or len(names) != len(meta["param_names"]):
        raise UserError(f"{path}: the saved state does not train this run's parameters, e.g. "
                        f"{(missing or sorted(set(names) - set(meta['param_names'])))[0]}")
    # A parameter that never had a gradient (e.g. the last block's text branch) has no optimizer state in the
    # saving run; the template made here has one for every parameter, so read only what was saved.
    saved_keys = set(meta["optimizer_keys"])
    tensors["optim"] = {k: v for k, v in tensors["optim"].items() if k in saved_keys}
    if len(tensors["optim"]) != len(saved_keys):
        raise UserError(f"{path}: the saved optimizer state does not match this run's parameters")
    dcp.load(tensors, storage_reader=HuggingFaceStorageReader(str(path / SHARDS)))
    set_model_state_dict(module, tensors["model"], options=StateDictOptions(strict=False))
    optim["state"] = {name: {key: tensors["optim"][f"{name}/{key}"] for key in state}
                      for name, state in optim["state"].items() if f"{name}/step" in saved_keys}
    for group, saved_group in zip(optim["param_groups"], meta["param_groups"]):
        group.update({k: (tuple(v) if isinstance(v, list) and k != "params" else v)
                      for k, v in saved_group.items() if k != "params"})
    # strict=False: the parameters left without state above (torch 2.13 refuses them otherwise)
    set_optimizer_state_dict(module, _inner_optimizer(optimizer), optim,
                             options=StateDictOptions(full_state_dict=False, strict=False))
    sched_state = schedule.state_dict()
    sched_state.update(meta["schedule"])
    schedule.load_state_dict(sched_state)
    rng_file = path / f"rng-{accelerator.process_index}.safetensors"
    if rng_file.exists():  # a run with more processes than the saving one keeps its own seeding
        rng = load_file(str(rng_file))
        torch.set_rng_state(rng["torch_cpu"])
        if torch.cuda.is_available() and "torch_cuda" in rng:
            torch.cuda.set_rng_state(rng["torch_cuda"])
    return meta["position"]


def _rng() -> dict[str, torch.Tensor]:
    out = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        out["torch_cuda"] = torch.cuda.get_rng_state()
    return out
