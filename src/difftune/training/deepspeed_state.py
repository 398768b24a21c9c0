"""The training state under DeepSpeed ZeRO (format 3 of `state.py`), without pickles.

DeepSpeed's own `save_checkpoint` writes pickled `.pt` files. Instead, every trained parameter's fp32 master
weight and optimizer moments are gathered whole through DeepSpeed's public accessors
(`deepspeed.utils.safe_get_full_fp32_param`, `safe_get_full_optimizer_state`: a collective call every process
makes, in the same order), and parameter i is written by process i mod N into `deepspeed-<rank>.safetensors`: each
process writes 1/N of the state and holds no more than that. Reading takes every parameter from the file of its
owner, so a state resumes under any ZeRO stage and number of processes; the optimizer's step count is in
state.json.
"""

from __future__ import annotations

from pathlib import Path

import torch

from ..errors import UserError

PART = "deepspeed-{rank}.safetensors"


def owner_of(index: int, world: int) -> int:
    """The process that writes the index-th trained parameter."""
    return index % world


def part_name(rank: int) -> str:
    return PART.format(rank=rank)


def _engine(module):
    if not hasattr(module, "optimizer") or not hasattr(getattr(module, "optimizer", None), "optimizer"):
        raise UserError("the DeepSpeed training state needs the module prepared by accelerate under DeepSpeed")
    return module, module.optimizer, module.optimizer.optimizer  # engine, ZeRO optimizer, torch / CPU Adam


def moment_keys(base) -> list[str]:
    """The base optimizer's tensor state besides its step count (AdamW: exp_avg, exp_avg_sq)."""
    keys = set()
    for state in base.state.values():
        keys |= {k for k, v in state.items() if k != "step" and isinstance(v, torch.Tensor) and v.dim() > 0}
    return sorted(keys)


def step_of(base) -> int:
    steps = {int(state["step"]) for state in base.state.values() if "step" in state}
    if len(steps) > 1:
        raise UserError(f"the DeepSpeed optimizer's parameter groups are at different steps ({sorted(steps)})")
    return steps.pop() if steps else 0


def trained(module, accelerator) -> list[tuple[str, torch.nn.Parameter]]:
    return [(n, p) for n, p in accelerator.unwrap_model(module).named_parameters() if p.requires_grad]


def save_deepspeed_tensors(accelerator, module, tmp: Path, final: Path, save) -> dict:
    """Every process writes its share of the whole tensors; returns what state.json records about them."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    _, _, base = _engine(module)
    keys, step = moment_keys(base), step_of(base)
    world, rank = accelerator.num_processes, accelerator.process_index
    params = trained(module, accelerator)
    mine = {}
    for i, (name, p) in enumerate(params):
        weight = safe_get_full_fp32_param(p)  # collective: every process, every parameter, in order
        moments = {k: safe_get_full_optimizer_state(p, k) for k in keys}
        if owner_of(i, world) == rank:
            mine[name] = weight.detach().float().cpu().contiguous()
            mine.update({f"{name}/{k}": v.detach().float().cpu().contiguous() for k, v in moments.items()})
    part = part_name(rank)
    save(mine or {"_empty": torch.zeros(0)}, tmp / part, final / part)
    return {"param_names": [n for n, _ in params], "optimizer_keys": keys, "optimizer_step": step,
            "parts": world}


class StateParts:
    """The parts of a format-3 state, each opened once; `tensors(i, name)` -> weight and moments of parameter i."""

    def __init__(self, path: Path, meta: dict):
        from safetensors import safe_open

        self.path, self.meta = Path(path), meta
        self.files = {}
        for rank in range(int(meta["parts"])):
            file = self.path / part_name(rank)
            if not file.is_file():
                raise UserError(f"{self.path}: {part_name(rank)} is missing (the state was written by "
                                f"{meta['parts']} processes, each its own part)")
            self.files[rank] = safe_open(str(file), framework="pt")

    def tensors(self, index: int, name: str) -> dict[str, torch.Tensor]:
        part = self.files[owner_of(index, int(self.meta["parts"]))]
        wanted = {"weight": name, **{k: f"{name}/{k}" for k in self.meta["optimizer_keys"]}}
        missing = [key for key in wanted.values() if key not in part.keys()]
        if missing:
            raise UserError(f"{self.path}: {part_name(owner_of(index, int(self.meta['parts'])))} lacks {missing[0]}")
        return {k: part.get_tensor(key) for k, key in wanted.items()}


def load_deepspeed_tensors(path: Path, meta: dict, accelerator, module) -> None:
    """The whole tensors into this run's partitions (any ZeRO stage, any number of processes)."""
    import deepspeed
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    from .state_names import check_names as _check_names

    _, zero, base = _engine(module)
    params = trained(module, accelerator)
    _check_names(path, meta["param_names"], [n for n, _ in params])
    parts = StateParts(path, meta)
    keys = list(meta["optimizer_keys"])
    order = {name: i for i, name in enumerate(meta["param_names"])}
    if keys:
        _create_optimizer_state(zero, base, keys)
    stage3 = any(hasattr(p, "ds_id") for _, p in params)
    for name, p in params:
        values = parts.tensors(order[name], name)
        safe_set_full_fp32_param(p, values["weight"])
        for key in keys:
            safe_set_full_optimizer_state(p, values[key], key)
        # the module's own copy of the weight (low precision under mixed precision) is refreshed from the master
        # weights only after a step: write it too
        with torch.no_grad():
            if stage3:
                with deepspeed.zero.GatheredParameters([p], modifier_rank=0):
                    if accelerator.is_main_process:
                        p.copy_(values["weight"].to(p.dtype))
            else:
                p.copy_(values["weight"].to(p.device, p.dtype))
    for state in base.state.values():
        if "step" in state:
            previous = state["step"]
            state["step"] = torch.tensor(float(meta["optimizer_step"]), dtype=previous.dtype) \
                if isinstance(previous, torch.Tensor) else type(previous)(meta["optimizer_step"])


def _create_optimizer_state(zero, base, keys: list[str]) -> None:
    """The base optimizer makes its state at its first step: make it now (zero moments, step 0) over DeepSpeed's
    flat fp32 partitions, and let ZeRO-1/2 link each parameter's fragment to it, so the setters have a target."""
    flats = getattr(zero, "fp32_partitioned_groups_flat", None) or \
        [flat for group in base.param_groups for flat in group["params"]]  # ZeRO-3 / ZeRO-1, 2
    if not flats:
        raise UserError("this DeepSpeed version keeps its fp32 partitions where difftune cannot find them: "
                        "the training state cannot be restored")
    counts_in_int = type(base).__module__.startswith("deepspeed.")  # DeepSpeed's CPU Adam: an int step
    for flat in flats:
        state = base.state.setdefault(flat, {})
        state.setdefault("step", 0 if counts_in_int else torch.tensor(0.0))
        for key in keys:
            state.setdefault(key, torch.zeros_like(flat))
    if hasattr(zero, "_lazy_init_hp_params_optimizer_state"):
        zero._lazy_init_hp_params_optimizer_state()


__all__ = ["StateParts", "load_deepspeed_tensors", "moment_keys", "owner_of", "part_name", "save_deepspeed_tensors",
           "step_of"]
