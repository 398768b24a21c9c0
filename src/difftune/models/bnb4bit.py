"""bitsandbytes' `Linear4bit` with its CPU kernel's shape constraint checked before the kernel is called.

On a CPU with AVX512-BF16, bitsandbytes repacks a 4-bit weight for its fused CPU kernel the first time the layer runs
in eval mode on an input that needs no gradient (a frozen text encoder, inference). The repacking takes only 2-D
weights whose output features are a multiple of 32 and whose input features are a multiple of the quantisation
block size (an `AssertionError: N must be divisible by block_n` or a failed reshape otherwise). Such layers run here
with their weight dequantised by bitsandbytes and a plain matmul: the same numbers bitsandbytes computes on any
other CPU. Imported only where bitsandbytes is installed (`quant.bitsandbytes()` says what to install otherwise).
"""

from __future__ import annotations

import bitsandbytes as bnb
import torch

BLOCK_N = 32  # the output-row tile of bitsandbytes' CPU packing (`_convert_weight_packed_for_cpu`'s block_n)
_noted = False


def cpu_kernel_refuses(shape, blocksize: int) -> str | None:
    """Why bitsandbytes' CPU 4-bit kernel cannot take a weight of `shape` ([out, in]) quantised in blocks of
    `blocksize`; None when it can."""
    if len(shape) != 2:
        return f"its weight is {len(shape)}-D"
    out_features, in_features = (int(d) for d in shape)
    if out_features % BLOCK_N:
        return f"out_features {out_features} is not a multiple of {BLOCK_N}"
    if in_features % 2 or in_features % blocksize:
        return f"in_features {in_features} is not a multiple of the block size {blocksize}"
    return None


def _kernel_route(layer: bnb.nn.Linear4bit, x: torch.Tensor) -> bool:
    """Whether bitsandbytes' forward would repack this layer for its CPU kernel now (its own condition)."""
    return (x.device.type == "cpu" and bool(getattr(layer, "support_avx512bf16_for_cpu", False))
            and not layer.training and not x.requires_grad
            and not getattr(layer.weight.quant_state, "packing_format_for_cpu", False))


class Linear4bit(bnb.nn.Linear4bit):
    """`bnb.nn.Linear4bit` whose CPU-kernel path is taken only for the shapes that kernel takes."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bnb.nn.modules.fix_4bit_weight_quant_state_from_module(self)
        state = self.weight.quant_state
        why = cpu_kernel_refuses(state.shape, state.blocksize) if _kernel_route(self, x) else None
        if why is None:
            return super().forward(x)
        global _noted
        if not _noted:
            _noted = True
            print(f"note: bitsandbytes' CPU 4-bit kernel cannot take a {list(state.shape)} layer ({why}); such layers "
                  f"run with their weights dequantised")
        dtype = self.compute_dtype or x.dtype
        weight = bnb.functional.dequantize_4bit(self.weight.data, state).to(dtype)
        bias = None if self.bias is None else self.bias.to(dtype)
        return torch.nn.functional.linear(x.to(dtype), weight, bias).to(x.dtype)
