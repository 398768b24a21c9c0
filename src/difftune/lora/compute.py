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
    """A LoRA A or B whose forward uses `compute_weight` (set by `ComputeCopies`) where the input allows it."""

    def forward(self, x):
        w = self.__dict__.get("compute_weight")
        if w is not None and (x.dtype == w.dtype or torch.is_autocast_enabled(x.device.type)):
            return F.linear(x, w)
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)  # outside training's autocast (validation)


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
        self.copies = [w.detach().to(dtype).requires_grad_() for w in self.masters]
        self._grads = [torch.empty_like(w) for w in self.masters]  # the masters' gradient buffers, reused
        for part, copy in zip(self.parts, self.copies):
            part.__class__ = _CopyLinear
            part.compute_weight = copy
        for layer in self.layers:
            layer.cast_input_dtype_enabled = False  # the input stays in the activations' dtype

    def __len__(self) -> int:
        return len(self.parts)

    @torch.no_grad()
    def collect(self) -> None:
        """Add the copies' gradients (this backward's) into the masters' fp32 gradients; clear the copies'."""
        fresh = [(m, c, g) for m, c, g in zip(self.masters, self.copies, self._grads)
                 if c.grad is not None and m.grad is None]
        more = [(m, c) for m, c in zip(self.masters, self.copies) if c.grad is not None and m.grad is not None]
        if fresh:
            torch._foreach_copy_([g for _, _, g in fresh], [c.grad for _, c, _ in fresh])
            for m, _, g in fresh:
                m.grad = g
        if more:  # gradient accumulation: summed in fp32
            torch._foreach_add_([m.grad for m, _ in more], [c.grad.float() for _, c in more])
        for c in self.copies:
            c.grad = None

    @torch.no_grad()
    def refresh(self) -> None:
        """The masters (just stepped, or loaded) into the copies."""
        if self.copies:
            torch._foreach_copy_(self.copies, self.masters)

    def remove(self) -> None:
        """Back to peft's own layers (fp32 adapters)."""
        for part in self.parts:
            part.__class__ = nn.Linear
            part.__dict__.pop("compute_weight", None)
        for layer in self.layers:
            layer.cast_input_dtype_enabled = True
        self.parts, self.layers, self.masters, self.copies, self._grads = [], [], [], [], []


def compute_dtype(mixed_precision: str | None) -> torch.dtype | None:
    """The adapters' compute dtype under accelerate's `mixed_precision` (None: no autocast, they stay fp32)."""
    return {"bf16": torch.bfloat16, "fp16": torch.float16}.get(mixed_precision or "no")
