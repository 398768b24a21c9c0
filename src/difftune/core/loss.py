"""What a training task is, for the trainer: the loss it computes, the values it reads, and how a run must be set up
for it. The shared losses (sft, direct_distill) live in training/losses.py; a family declares its own in
`FamilySpec.losses` (a `--task <name>` only that family has)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass


@dataclass(frozen=True)
class Loss:
    fn: Callable  # (pipe, values, generators, settings) -> a scalar tensor
    reads: tuple[str, ...] = ()  # the values it reads besides what model_fn reads (the split needs them)
    # The units also compute the negative (unconditional) side of prompt-dependent values, which the loss reads
    # (e.g. a teacher sampled with guidance): they run with classifier-free guidance on, in both stages.
    cfg: bool = False
    # Called once with the training module after its trainable weights are set up (LoRA injected, checkpoints
    # loaded), e.g. to keep a frozen copy of the denoiser as a teacher.
    prepare: Callable | None = None


def as_loss(entry) -> Loss:
    """A `Loss`, or the older (fn, reads) pair."""
    if isinstance(entry, Loss):
        return entry
    fn, reads = entry
    return Loss(fn, tuple(reads))


__all__ = ["Loss", "as_loss"]
