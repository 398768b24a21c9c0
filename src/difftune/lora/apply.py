"""Applying a LoRA file to a model: as a trainable adapter (continue training) or fused into the weights."""

from __future__ import annotations

import logging
import re
from collections import Counter
from collections.abc import Iterable

import torch
from torch import nn

from ..errors import UserError
from ..util import names as _names
from .formats import ImportedLora, _fit
from .inject import _linear_of, _lora_layers, _suffix_match, inject_lora

logger = logging.getLogger(__name__)

# -- apply ----------------------------------------------------------------------------------------------

def load_lora_into(module: nn.Module, imported: ImportedLora, adapter_name: str = "default", trainable: bool = True,
                   component: str | None = None, target_modules: Iterable[str] | str | None = None,
                   rank: int | None = None, alpha: float | None = None,
                   exclude_modules: Iterable[str] | str | None = None):
    """Inject a LoRA adapter holding the file's weights (e.g. to continue training); returns its LoraConfig.

    The file's rank and alpha win over `rank` / `alpha` (a warning says so when they differ). With
    `target_modules`, modules they select that the file lacks start fresh (B = 0); a module of the file
    that they do not select is a UserError. Without them, exactly the file's modules get the adapter.
    """
    from peft.tuners.lora import LoraLayer

    _, fitted = _fit(imported, module, component)
    ranks = {real: a.shape[0] for real, a, _, _ in fitted.values()}
    alphas = {real: al for real, _, _, al in fitted.values()}
    r = Counter(ranks.values()).most_common(1)[0][0]
    a = Counter(alphas.values()).most_common(1)[0][0]
    if rank is not None and int(rank) != r:
        logger.warning("%s: the LoRA has rank %d; --lora_rank %s is ignored", imported.source, r, rank)
    if alpha is not None and float(alpha) != a:
        logger.warning("%s: the LoRA has alpha %g; --lora_alpha %s is ignored", imported.source, a, alpha)
    targets, exclude = _names(target_modules), _names(exclude_modules)
    if targets:
        uncovered = [p for p in ranks if not any(_suffix_match(p, t) for t in targets)
                     or any(_suffix_match(p, e) for e in exclude)]
        if uncovered:
            raise UserError(f"--lora_target_modules does not cover {len(uncovered)} modules of {imported.source} "
                            f"(e.g. '{uncovered[0]}'); add them or leave the flag out to use the file's modules")
    else:
        targets, exclude = sorted(ranks), []
    config = inject_lora(module, targets, r, a, exclude_modules=exclude, adapter_name=adapter_name,
                         rank_pattern={re.escape(p): v for p, v in ranks.items() if v != r},
                         alpha_pattern={re.escape(p): v for p, v in alphas.items() if v != a})
    with torch.no_grad():
        for path, wa, wb, _ in fitted.values():
            layer = module.get_submodule(path)
            assert isinstance(layer, LoraLayer) and adapter_name in layer.lora_A, path
            layer.lora_A[adapter_name].weight.copy_(wa)
            layer.lora_B[adapter_name].weight.copy_(wb)
    if not trainable:
        for _, layer in _lora_layers(module, adapter_name):
            for p in (*layer.lora_A[adapter_name].parameters(), *layer.lora_B[adapter_name].parameters()):
                p.requires_grad_(False)
    return config


@torch.no_grad()
def fuse_lora(module: nn.Module, imported: ImportedLora, scale: float = 1.0,
              component: str | None = None) -> list[str]:
    """Merge W += scale * (alpha / r) * B @ A into the base Linear weights; no peft layer is left behind.

    Computed in fp32 and cast back once, so bf16 and float8 weights take the sum rounded a single time
    (a delta below the float8 step is lost, as with any float8 weight). Returns the fused module paths.
    """
    _, fitted = _fit(imported, module, component)
    for path, a, b, alpha in fitted.values():
        weight = _linear_of(module.get_submodule(path)).weight
        if type(weight.data) is not torch.Tensor or not weight.dtype.is_floating_point:
            raise UserError(f"{imported.source}: cannot fuse into '{path}': its weight is stored as "
                            f"{type(weight.data).__name__}/{weight.dtype} (quantized); load the model unquantized")
        # a convolution's LoRA (LoCon): B (out, r, 1, ...) @ A (r, in, k, ...) as matrices, in the kernel's shape
        delta = (b.to(weight.device, torch.float32).flatten(1) @ a.to(weight.device, torch.float32).flatten(1))
        delta = delta.reshape(weight.shape)
        merged = weight.to(torch.float32) + delta * (float(scale) * alpha / a.shape[0])
        weight.copy_(merged.to(weight.dtype))
    return [real for real, *_ in fitted.values()]

