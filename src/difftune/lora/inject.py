"""LoRA on a model through peft: inject an adapter, read its weights back in canonical form.

The canonical form inside difftune is one state dict per component with keys `<module path>.lora_A.weight`
and `<module path>.lora_B.weight` (peft's naming minus the adapter name), fp32, plus an alpha per module.

Injection uses `peft.inject_adapter_in_model` rather than `add_adapter`: diffusers' `ModelMixin.add_adapter`
is that same call plus bookkeeping, transformers' `PreTrainedModel.add_adapter` has its own signature and
checks, and a plain `nn.Module` has neither. We do the shared bookkeeping (`peft_config`,
`_hf_peft_config_loaded`) ourselves so diffusers' and transformers' adapter helpers still see the adapter.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import torch
from torch import nn

from ..errors import UserError
from ..util import names as _names

_PEFT_PARTS = {"base_layer", "lora_A", "lora_B", "lora_dropout", "lora_embedding_A", "lora_embedding_B",
               "lora_magnitude_vector"}
_WEIGHT_KEY = re.compile(r"^(?P<path>.+?)\.(?P<kind>lora_A|lora_B|lora_down|lora_up)(?:\.(?P<adapter>[^.]+))?\.weight$")
def _suffix_match(name: str, target: str) -> bool:
    # peft's rule for a list of target_modules / exclude_modules
    return name == target or name.endswith("." + target)


def _is_peft_internal(name: str) -> bool:
    return any(part in _PEFT_PARTS for part in name.split("."))


# The layers a LoRA adapts (peft's LoRA layers for them; a convolution's LoRA is a LoCon: A a convolution of the
# layer's kernel to rank r, B a 1x1 convolution back)
ADAPTABLE = (nn.Linear, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def _linear_of(m: nn.Module | None) -> nn.Module | None:
    """The Linear (or convolution) layer itself, or the one a peft layer wraps; None for any other module."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    if isinstance(m, BaseTunerLayer):
        m = m.get_base_layer()
    return m if isinstance(m, ADAPTABLE) else None


def layer_sides(layer: nn.Module) -> tuple[int, int]:
    """(in, out) features of a Linear, channels of a convolution."""
    if isinstance(layer, nn.Linear):
        return layer.in_features, layer.out_features
    return layer.in_channels, layer.out_channels


def _short_name(name: str) -> str:
    # `transformer_blocks.0.attn.to_q` -> `attn.to_q`: the part users put in --lora_target_modules
    parts = name.split(".")
    for i, p in enumerate(parts[:-1]):
        if p.isdigit():
            return ".".join(parts[i + 1:])
    return name


def _linear_examples(module: nn.Module, limit: int = 12) -> str:
    seen: list[str] = []
    for name, m in module.named_modules():
        if name and not _is_peft_internal(name) and _linear_of(m) is not None:
            short = _short_name(name)
            if short not in seen:
                seen.append(short)
    more = f", ... ({len(seen)} in all)" if len(seen) > limit else ""
    return ", ".join(seen[:limit]) + more if seen else "none"


def _check_targets(module: nn.Module, targets: list[str], exclude: list[str]) -> list[str]:
    """The module names the targets select (peft's suffix rule); UserError for targets matching nothing."""
    names = [n for n, _ in module.named_modules() if n and not _is_peft_internal(n)]
    unmatched = [t for t in targets if not any(_suffix_match(n, t) for n in names)]
    if unmatched:
        raise UserError(f"--lora_target_modules: {', '.join(unmatched)} match no module of {type(module).__name__} "
                        f"(its Linear layers include: {_linear_examples(module)})")
    selected = [n for n in names if any(_suffix_match(n, t) for t in targets)
                and not any(_suffix_match(n, e) for e in exclude)]
    if not selected:
        raise UserError(f"--lora_target_modules: every module matched by {', '.join(targets)} is excluded")
    for n in selected:
        m = module.get_submodule(n)
        if _linear_of(m) is None:
            raise UserError(f"--lora_target_modules: '{n}' is a {type(m).__name__}, not a Linear or convolution "
                            f"layer (such layers include: {_linear_examples(module)})")
    return selected


def _lora_layers(module: nn.Module, adapter_name: str):
    from peft.tuners.lora import LoraLayer

    for name, m in module.named_modules():
        if isinstance(m, LoraLayer) and adapter_name in m.lora_A:
            yield name, m


def inject_lora(module: nn.Module, target_modules: Iterable[str] | str, rank: int, alpha: float | None = None,
                init: Any = "default", exclude_modules: Iterable[str] | str | None = None,
                adapter_name: str = "default", rank_pattern: Mapping[str, int] | None = None,
                alpha_pattern: Mapping[str, float] | None = None):
    """Add a LoRA adapter to `module` in place; returns its `peft.LoraConfig`.

    Targets are matched like peft (a module whose name equals or ends with `.<target>`). `alpha` defaults
    to `rank`. `init`: "default" (B = 0, so the output is unchanged), "gaussian", False (random A and B,
    for tests) or any other `init_lora_weights` value peft knows. LoRA parameters are fp32 whatever the
    base dtype (mixed precision comes from autocast); afterwards only this adapter's parameters require grad.
    """
    from peft import LoraConfig, inject_adapter_in_model

    targets, exclude = _names(target_modules), _names(exclude_modules)
    if not targets:
        raise UserError("--lora_target_modules is empty: name the modules to put LoRA on, e.g. to_q,to_k,to_v")
    if int(rank) < 1:
        raise UserError(f"--lora_rank must be at least 1 (got {rank})")
    previous = dict(getattr(module, "peft_config", None) or {})
    if adapter_name in previous:
        raise ValueError(f"{type(module).__name__} already has a LoRA adapter named {adapter_name!r}")
    _check_targets(module, targets, exclude)
    config = LoraConfig(
        r=int(rank), lora_alpha=float(rank if alpha is None else alpha), target_modules=targets,
        exclude_modules=exclude or None, init_lora_weights=True if init in ("default", True) else init,
        rank_pattern=dict(rank_pattern or {}), alpha_pattern=dict(alpha_pattern or {}))
    inject_adapter_in_model(config, module, adapter_name=adapter_name)
    # peft replaces module.peft_config with a dict holding only the new adapter; keep earlier ones.
    module.peft_config = {**previous, **module.peft_config}
    if hasattr(module, "_hf_peft_config_loaded"):
        module._hf_peft_config_loaded = True
    lora_params = set()
    for _, layer in _lora_layers(module, adapter_name):
        for part in (layer.lora_A[adapter_name], layer.lora_B[adapter_name]):
            part.to(torch.float32)  # peft copies the base dtype (bf16, even fp8); keep the adapter in fp32
            lora_params.update(id(p) for p in part.parameters())
    for p in module.parameters():
        p.requires_grad_(id(p) in lora_params)
    return config


def lora_state_dict(module: nn.Module, adapter_name: str = "default") -> dict[str, torch.Tensor]:
    """The adapter's weights in canonical form: `<module path>.lora_A.weight` / `.lora_B.weight`, fp32
    (peft's `get_peft_model_state_dict`, which drops the adapter name from the keys). The parts of a shared adapter
    (`share_lora`) are written as separate modules: each with the shared lora_A and its rows of the lora_B."""
    from peft import get_peft_model_state_dict

    if adapter_name not in (getattr(module, "peft_config", None) or {}):
        raise ValueError(f"{type(module).__name__} has no LoRA adapter named {adapter_name!r}")
    state = get_peft_model_state_dict(module, adapter_name=adapter_name, save_embedding_layers=False)
    out = {k: v.detach().float().contiguous() for k, v in state.items() if not k.endswith(".lora_B.fused")}
    for name, layer in _lora_layers(module, adapter_name):
        up = layer.lora_B[adapter_name]
        if isinstance(up, SharedUp):  # own copies: the parts' A are one tensor, their B views of one
            out[f"{name}.lora_A.weight"] = layer.lora_A[adapter_name].weight.detach().float().clone()
            out[f"{name}.lora_B.weight"] = up.weight.detach().float().clone()
    return out


# -- one adapter over several layers (a layer the reference's model fuses, e.g. q, k, v in one Linear) ---------

class SharedUp(nn.Module):
    """The lora_B of one part of a shared adapter: rows `start:stop` of the group's up-projection, a parameter of
    the group's first part (`fused`, all the parts' rows); the others hold no parameter of their own."""

    def __init__(self, fused: nn.Parameter | None, first: SharedUp | None, start: int, stop: int):
        super().__init__()
        if first is None:
            self.fused = fused
        self.__dict__["first"] = first  # not a submodule: its parameter is counted once
        self.start, self.stop = int(start), int(stop)
        self.in_features, self.out_features = (fused if first is None else first.fused).shape[1], stop - start

    def full(self) -> torch.Tensor:
        return self.fused if self.first is None else self.first.fused

    @property
    def weight(self) -> torch.Tensor:
        return self.full()[self.start:self.stop]

    def forward(self, x):
        return torch.nn.functional.linear(x, self.weight)


def share_lora(module: nn.Module, groups: Iterable[Iterable[str]], adapter_name: str = "default"
               ) -> list[tuple[tuple[str, ...], str]]:
    """Make each group of `module`'s LoRA layers (their full module paths, in the order of the fused layer's rows)
    one adapter, as a LoRA on one Linear layer holding them all: one lora_A shared by the parts and one lora_B whose
    rows are the parts' (`SharedUp`). The update is exact: a part whose lora_B is zero (fresh) takes the shared A
    without a change; parts with a non-zero lora_B must hold one lora_A already (a file written from a shared
    adapter). Returns the groups left as separate adapters, each with why."""
    left = []
    for group in groups:
        paths = tuple(group)
        layers = [module.get_submodule(p) for p in paths]
        problem = None
        if any(adapter_name not in getattr(m, "lora_A", {}) for m in layers):
            problem = "a part has no LoRA"
        elif any(isinstance(m.lora_B[adapter_name], SharedUp) for m in layers):
            problem = "a part is shared already"
        elif any(type(m.lora_A[adapter_name]) is not nn.Linear for m in layers):
            problem = "a part is no Linear layer's LoRA"
        elif len({(m.lora_A[adapter_name].weight.shape, float(m.scaling[adapter_name])) for m in layers}) != 1:
            problem = "the parts' ranks or alphas differ"
        else:
            live = [m for m in layers if torch.count_nonzero(m.lora_B[adapter_name].weight).item()]
            down = (live or layers)[0].lora_A[adapter_name]
            if any(not torch.equal(m.lora_A[adapter_name].weight, down.weight) for m in live):
                problem = "the parts hold different lora_A"
        if problem:
            left.append((paths, problem))
            continue
        ups = [m.lora_B[adapter_name].weight for m in layers]
        fused = nn.Parameter(torch.cat([u.detach() for u in ups]), requires_grad=ups[0].requires_grad)
        first, row = None, 0
        for m, u in zip(layers, ups):
            part = SharedUp(fused, first, row, row + u.shape[0])
            first = first or part
            row += u.shape[0]
            m.lora_A[adapter_name] = down
            m.lora_B[adapter_name] = part
    return left


def shared_lora_parts(module: nn.Module, adapter_name: str = "default") -> dict[str, list[str]]:
    """{the first part's path: every part's path, in row order} for the shared adapters of `module`."""
    parts = [(name, layer.lora_B[adapter_name]) for name, layer in _lora_layers(module, adapter_name)
             if isinstance(layer.lora_B[adapter_name], SharedUp)]
    firsts = {id(up): name for name, up in parts if up.first is None}
    out: dict[str, list[tuple[int, str]]] = {}
    for name, up in parts:  # the model may register a later row's layer first (an MLP input before the attention)
        out.setdefault(firsts[id(up.first or up)], []).append((up.start, name))
    return {first: [name for _, name in sorted(rows)] for first, rows in out.items()}


def expand_shared_lora(module: nn.Module, state: Mapping[str, torch.Tensor], adapter_name: str = "default"
                       ) -> dict[str, torch.Tensor]:
    """A state of `module`'s trained parameters by name (`<path>.lora_A.<adapter>.weight`, as `named_parameters`
    gives them: a shared adapter's lora_A under its first part, its `lora_B.<adapter>.fused` there) with each shared
    adapter written out as its parts: the same lora_A for each, each its rows of the lora_B."""
    out = dict(state)
    for first, parts in shared_lora_parts(module, adapter_name).items():
        fused = out.pop(f"{first}.lora_B.{adapter_name}.fused", None)
        # the shared lora_A is named after the part the model registers first, which need not be the first row's
        down = next((out[k] for k in (f"{p}.lora_A.{adapter_name}.weight" for p in parts) if k in out), None)
        if fused is None or down is None:
            continue
        for path in parts:
            up = module.get_submodule(path).lora_B[adapter_name]
            out[f"{path}.lora_A.{adapter_name}.weight"] = down.clone()
            out[f"{path}.lora_B.{adapter_name}.weight"] = fused[up.start:up.stop].clone()
    return out


def canonical_lora_keys(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`x.lora_A.<adapter>.weight` (a module's own parameter names) -> `x.lora_A.weight`, fp32, contiguous."""
    out: dict[str, torch.Tensor] = {}
    for key, value in state_dict.items():
        m = _WEIGHT_KEY.match(key)
        if m is None or m["kind"] not in ("lora_A", "lora_B"):
            raise ValueError(f"not a peft LoRA weight: {key!r}")
        canonical = f"{m['path']}.{m['kind']}.weight"
        if canonical in out:
            raise ValueError(f"two adapters for {canonical!r}; export one adapter at a time")
        out[canonical] = value.detach().float().contiguous()
    return out


def _module_paths(sd: Mapping[str, torch.Tensor]) -> list[str]:
    return sorted(k[: -len(".lora_A.weight")] for k in sd if k.endswith(".lora_A.weight"))


