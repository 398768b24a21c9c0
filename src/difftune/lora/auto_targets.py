"""`--lora_target_modules ""`: the reference's automatic choice of LoRA targets.

The reference walks the model's children; inside every nn.ModuleList of more than one module (the repeated
blocks) it takes each Linear layer with min(in_features, out_features) >= 512, by its full name. The same rule on
the same class picks the same modules, so a command that leaves the targets to it trains what the reference trains.
"""

from __future__ import annotations

from torch import nn

from ..errors import UserError
from .inject import _short_name

AUTO = "(auto)"  # the list flag's value for an empty --lora_target_modules: choose as the reference does
MIN_SIDE = 512


def auto_target_modules(model: nn.Module, min_side: int = MIN_SIDE) -> list[str]:
    """The full names of the Linear layers the reference's rule picks in `model` (in module order)."""
    out: list[str] = []

    def walk(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            full = f"{prefix}.{name}" if prefix else name
            if isinstance(child, nn.ModuleList) and len(child) > 1:
                for sub, m in child.named_modules(prefix=full):  # fp8 and 4-bit layers are Linear subclasses
                    if isinstance(m, nn.Linear) and min(m.in_features, m.out_features) >= min_side:
                        out.append(sub)
            else:
                walk(child, full)

    walk(model, "")
    return out


def resolve_auto_targets(model: nn.Module, slot: str, log=print) -> list[str]:
    """The auto-detected targets of `slot`'s model, logged (how many, and the distinct module names inside the
    blocks); none found is refused in one line."""
    targets = auto_target_modules(model)
    if not targets:
        raise UserError(f"--lora_target_modules \"\": no Linear layer of at least {MIN_SIDE} features on both sides "
                        f"in {type(model).__name__}'s block lists ({slot}), which is where the reference's automatic "
                        f"choice looks: name the modules to put LoRA on")
    short = dict.fromkeys(_short_name(t) for t in targets)
    log(f"note: --lora_target_modules \"\": {len(targets)} modules of {slot} chosen as the reference chooses (Linear "
        f"layers of at least {MIN_SIDE} features in block lists): {', '.join(short)}")
    return targets


__all__ = ["AUTO", "MIN_SIDE", "auto_target_modules", "resolve_auto_targets"]
