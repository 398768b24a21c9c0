"""FP8 weight storage for frozen models: weights kept in float8_e4m3fn, computed in a wider dtype.

Storage only (half the memory of bf16, no speed-up): each forward casts the weight to `compute_dtype`.
A converted layer keeps its class's behaviour and stays an `nn.Linear` (or conv) subclass, so peft can
still put a LoRA on it; `compute_dtype` is the attribute peft reads to create the LoRA weights in the
compute dtype rather than in fp8. Training the fp8 weights themselves is refused.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from ..errors import UserError
from ..util import names as split_names

FP8 = torch.float8_e4m3fn
_CONVS = (nn.Conv1d, nn.Conv2d, nn.Conv3d)


class _Fp8Weight:
    compute_dtype: torch.dtype

    def _compute_weights(self, x: torch.Tensor):
        if self.weight.requires_grad and torch.is_grad_enabled():
            raise UserError(f"a {type(self).__name__} weight stored in float8 is set trainable; FP8 storage is only "
                            f"for frozen models (train a LoRA on it, or drop it from --fp8_models)")
        bias = self.bias.to(self.compute_dtype) if self.bias is not None else None
        return x.to(self.compute_dtype), self.weight.to(self.compute_dtype), bias

    def _apply(self, fn, recurse=True):
        # `model.to(dtype)` / `.float()` would upcast the fp8 weight (fp8 counts as floating point): keep it fp8
        # (fp8 -> wider -> fp8 is exact), let device changes through, and compute in the new dtype.
        super()._apply(fn, recurse)
        probe = fn(torch.empty(0, dtype=self.compute_dtype))
        if isinstance(probe, torch.Tensor) and probe.is_floating_point() and probe.dtype != FP8:
            self.compute_dtype = probe.dtype
        if self.weight.dtype != FP8 and not self.weight.is_meta:
            self.weight.data = self.weight.data.to(FP8)
        return self


class Fp8Linear(_Fp8Weight, nn.Linear):
    def forward(self, x):
        return F.linear(*self._compute_weights(x))


class _Fp8Conv(_Fp8Weight):
    def _conv_forward(self, input, weight, bias):  # every nn.ConvNd forward (and subclasses') goes through here
        x, w, b = self._compute_weights(input)
        return super()._conv_forward(x, w, b)


_CLASSES: dict[type, type] = {nn.Linear: Fp8Linear}


def _fp8_class(cls: type) -> type:
    if cls not in _CLASSES:
        mixin = Fp8Linear if issubclass(cls, nn.Linear) else _Fp8Conv
        _CLASSES[cls] = type(f"Fp8{cls.__name__}", (mixin, cls), {"__module__": __name__})
    return _CLASSES[cls]


def _eligible(name: str, module: nn.Module, include_conv: bool) -> bool:
    if isinstance(module, _Fp8Weight) or any(part.startswith("lora_") for part in name.split(".")):
        return False  # already converted, or a LoRA's own (trainable) layers
    cls = type(module)
    if isinstance(module, nn.Linear):
        return cls.forward is nn.Linear.forward  # a custom forward might not use F.linear(weight)
    if include_conv and isinstance(module, _CONVS):
        return cls._conv_forward in (c._conv_forward for c in _CONVS)
    return False


def fp8_weight_names(module: nn.Module, include_conv: bool = False) -> list[str]:
    """State-dict names of the weights `enable_fp8_storage` stores in fp8 (the loader casts them as it reads)."""
    return [f"{n}.weight" if n else "weight" for n, m in module.named_modules() if _eligible(n, m, include_conv)]


def enable_fp8_storage(module: nn.Module, compute_dtype: torch.dtype = torch.bfloat16,
                       include_conv: bool = False) -> int:
    """Store every Linear (and with `include_conv`, conv) weight of `module` in float8_e4m3fn, in place.

    Call it on a frozen model, before injecting a LoRA. Returns the number of converted layers.
    """
    count = 0
    for name, sub in list(module.named_modules()):
        if not _eligible(name, sub, include_conv):
            continue
        sub.__class__ = _fp8_class(type(sub))
        sub.compute_dtype = compute_dtype
        with torch.no_grad():
            sub.weight.requires_grad_(False)
            if sub.weight.dtype != FP8:
                sub.weight.data = sub.weight.data.to(FP8)
        count += 1
    return count


def check_fp8_frozen(names: Iterable[str], trainable: str | Iterable[str] | None) -> None:
    """Refuse FP8 storage for a model that is trained in full (`--trainable_models`); LoRA on it is fine."""
    both = sorted(set(split_names(list(names))) & set(split_names(trainable)))
    if both:
        raise UserError(f"--fp8_models: {', '.join(both)} is also in --trainable_models; FP8 storage is only for "
                        f"frozen models (train a LoRA on it with --lora_base_model instead)")
