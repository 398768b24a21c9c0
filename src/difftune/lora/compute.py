"""LoRA adapters that compute in the activations' dtype while the optimizer steps fp32 master weights.

Under bf16/fp16 autocast, fp32 adapters cost a cast pair per LoRA layer and pass (peft casts the input up to the
adapter's dtype, autocast casts it and the weights back down, and the backward casts the gradients up again). Here the
adapter's parameters stay fp32 (they are what the optimizer steps, what is saved and resumed) and each `lora_A` /
`lora_B` computes with a low-precision copy of its weight, a leaf of its own. After each backward the copies'
gradients are added into the masters' fp32 gradients (a few foreach calls for all layers), and after each optimizer
step the masters are copied back into the copies. The forward computes exactly what autocast computed from the fp32
weights (the same rounding to bf16), so a bf16 step is unchanged up to the order of float sums.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class _CopyLinear(nn.Linear):
    """A LoRA A or B whose forward uses `compute_weight_t` (its weight's transpose in the compute dtype, set by
    `ComputeCopies`) where the input allows it."""

    def forward(self, x):
        wt = self.__dict__.get("compute_weight_t")
        if wt is not None and (x.dtype == wt.dtype or torch.is_autocast_enabled(x.device.type)):
            return torch.matmul(x, wt)
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)  # outside training's autocast (validation)


def _fused_forward(self, x, *args, **kwargs):
    """peft's LoRA Linear forward, with the copies: the input cast once for the base layer and the adapters (autocast
    would cast it for each) and flattened once, a plain base Linear applied as one `addmm` on the flat input, and each
    adapter's up-projection, scaling and sum in one more `addmm`."""
    copies = self.__dict__.get("_difftune_copies")
    dtype = self.__dict__.get("_difftune_dtype")
    if (copies is None or args or kwargs or self.disable_adapters or self.merged
            or not (x.dtype == dtype or torch.is_autocast_enabled(x.device.type))):
        return type(self).__mro__[1].forward(self, x, *args, **kwargs)
    x = x.to(dtype)
    flat = x.reshape(-1, x.shape[-1])
    base = self.base_layer
    if type(base) is nn.Linear:
        if torch.compiler.is_compiling():
            wt = base.weight.t()  # free inside a compiled graph
        else:
            wt = self.__dict__.get("_difftune_base_t")
            if wt is None or wt.data_ptr() != base.weight.data_ptr():  # made once (the frozen weight stays put)
                wt = self._difftune_base_t = base.weight.t()
        out = flat.mm(wt) if base.bias is None else torch.addmm(base.bias, flat, wt)
    else:  # fp8, quantized: the layer's own forward
        out = base(flat)
    for name in self.active_adapters:
        if name in copies:
            at, bt = copies[name]
            out = torch.addmm(out, flat.mm(at), bt, alpha=self.scaling[name])
    return out.view(*x.shape[:-1], out.shape[-1])


_FUSED: dict[type, type] = {}


def _fused_class(cls: type) -> type:
    if cls not in _FUSED:
        _FUSED[cls] = type(cls.__name__, (cls,), {"forward": _fused_forward, "__module__": __name__})
    return _FUSED[cls]


class ComputeCopies:
    """The trainable LoRA layers of `module` computing in `dtype` from their fp32 weights (the masters)."""

    def __init__(self, module: nn.Module, dtype: torch.dtype):
        from peft.tuners.lora import LoraLayer

        self.dtype = dtype
        self.parts: list[nn.Linear] = []
        self.layers: list = []
        for m in module.modules():
            if not isinstance(m, LoraLayer):
                continue
            mine = [part for name in m.lora_A for part in (m.lora_A[name], m.lora_B[name])
                    if type(part) is nn.Linear and part.bias is None and part.weight.requires_grad
                    and part.weight.dtype == torch.float32 and name not in getattr(m, "lora_variant", {})]
            if len(mine) != 2 * len(m.lora_A):
                continue  # DoRA, a frozen adapter, biases: left as peft computes them
            self.layers.append(m)
            self.parts.extend(mine)
        self.masters = [p.weight for p in self.parts]
        # the copies hold the transposes (in x out, contiguous): a matmul takes them as they are, with no transpose
        # operator per call; the views of the masters and of their gradient buffers are made once
        self._masters_t = [w.t() for w in self.masters]
        self.copies = [w.detach().to(dtype).contiguous().requires_grad_() for w in self._masters_t]
        self._grads = [torch.empty_like(w) for w in self.masters]  # the masters' gradient buffers, reused
        self._grads_t = [g.t() for g in self._grads]
        for part, copy in zip(self.parts, self.copies):
            part.__class__ = _CopyLinear
            part.compute_weight_t = copy
        from peft.tuners.lora.layer import Linear as LoraLinear

        by_weight = {id(w): c for w, c in zip(self.masters, self.copies)}
        for layer in self.layers:
            layer.cast_input_dtype_enabled = False  # the input stays in the activations' dtype
            if type(layer) is LoraLinear:
                layer.__class__ = _fused_class(LoraLinear)
                layer._difftune_dtype = dtype
                layer._difftune_copies = {n: (by_weight[id(layer.lora_A[n].weight)], by_weight[id(layer.lora_B[n].weight)])
                                          for n in layer.lora_A}

    def __len__(self) -> int:
        return len(self.parts)

    @torch.no_grad()
    def collect(self) -> None:
        """Add the copies' gradients (this backward's) into the masters' fp32 gradients; clear the copies'."""
        fresh = [(m, c, g, gt) for m, c, g, gt in zip(self.masters, self.copies, self._grads, self._grads_t)
                 if c.grad is not None and m.grad is None]
        more = [(m, c) for m, c in zip(self.masters, self.copies) if c.grad is not None and m.grad is not None]
        if fresh:
            torch._foreach_copy_([gt for *_, gt in fresh], [c.grad for _, c, *_ in fresh])
            for m, _, g, _ in fresh:
                m.grad = g
        if more:  # gradient accumulation: summed in fp32
            torch._foreach_add_([m.grad.t() for m, _ in more], [c.grad.float() for _, c in more])
        for c in self.copies:
            c.grad = None

    @torch.no_grad()
    def refresh(self) -> None:
        """The masters (just stepped, or loaded) into the copies."""
        if self.copies:
            torch._foreach_copy_(self.copies, self._masters_t)

    def remove(self) -> None:
        """Back to peft's own layers (fp32 adapters)."""
        for part in self.parts:
            part.__class__ = nn.Linear
            part.__dict__.pop("compute_weight_t", None)
        for layer in self.layers:
            layer.cast_input_dtype_enabled = True
            if type(layer) in _FUSED.values():
                layer.__class__ = type(layer).__mro__[1]
            layer.__dict__.pop("_difftune_copies", None)
            layer.__dict__.pop("_difftune_dtype", None)
            layer.__dict__.pop("_difftune_base_t", None)
        self.parts, self.layers, self.masters, self.copies = [], [], [], []
        self._masters_t, self._grads, self._grads_t = [], [], []


def compute_dtype(mixed_precision: str | None) -> torch.dtype | None:
    """The adapters' compute dtype under accelerate's `mixed_precision` (None: no autocast, they stay fp32)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision or "no")
