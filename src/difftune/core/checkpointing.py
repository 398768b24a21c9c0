"""Gradient checkpointing for model_fn code: diffusers' own block checkpointing (with an optional CPU offload of
the saved inputs) and `gradient_checkpoint_forward` for any module a family's model_fn calls."""

from __future__ import annotations

import torch


def checkpoint_function(offload: bool):
    """A gradient-checkpointing function for diffusers' blocks; `offload` keeps the saved inputs on CPU. Keyword
    arguments are passed through (diffusers' Wan-Animate-2 blocks take their KV cache and settings by name);
    keyword tensors are offloaded as the positional ones are."""

    def checkpointed(module, *args, **kwargs):
        if not offload:
            return torch.utils.checkpoint.checkpoint(module, *args, use_reentrant=False, **kwargs)
        tensors = [a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)]
        device = tensors[0].device if tensors else None
        names, n = list(kwargs), len(args)

        def run(*cpu_args):
            back = [a.to(device, non_blocking=True) if isinstance(a, torch.Tensor) else a for a in cpu_args]
            return module(*back[:n], **dict(zip(names, back[n:])))

        # The checkpoint holds only what it is given: CPU copies. Their `.to(device)` is recomputed in backward.
        cpu_args = [a.to("cpu") if isinstance(a, torch.Tensor) else a for a in (*args, *kwargs.values())]
        return torch.utils.checkpoint.checkpoint(run, *cpu_args, use_reentrant=False)

    return checkpointed


def set_gradient_checkpointing(model, enabled: bool, offload: bool = False) -> None:
    state = (bool(enabled), bool(offload))
    if getattr(model, "_difftune_ckpt", None) == state:
        return
    if enabled:
        model.enable_gradient_checkpointing(gradient_checkpointing_func=checkpoint_function(offload))
    elif getattr(model, "is_gradient_checkpointing", False):
        model.disable_gradient_checkpointing()
    model._difftune_ckpt = state


def gradient_checkpoint_forward(module, use_gradient_checkpointing: bool, use_gradient_checkpointing_offload: bool,
                                *args, **kwargs):
    """`module(*args, **kwargs)`, recomputed in backward instead of keeping its activations when
    `use_gradient_checkpointing` is on (and gradients are being taken); `..._offload` keeps the
    saved inputs in CPU memory."""
    if not (use_gradient_checkpointing and torch.is_grad_enabled()):
        return module(*args, **kwargs)
    names = list(kwargs)
    n = len(args)

    def call(*flat):  # keyword tensors go through the checkpoint positionally, so they are offloaded too
        return module(*flat[:n], **dict(zip(names, flat[n:])))

    return checkpoint_function(bool(use_gradient_checkpointing_offload))(call, *args, *kwargs.values())


def checkpoint_whole(module, enabled: bool, offload: bool = False) -> None:
    """Run `module`'s forward under gradient checkpointing (its children's calls, and their hooks, inside it), or as
    it is again: for a part of a model its own checkpointing leaves out (Krea-2's text fusion blocks), whose
    activations are otherwise kept and whose blocks model offload cannot stream."""
    state = (bool(enabled), bool(offload))
    if module.__dict__.get("_difftune_whole_ckpt", (False, False)) == state:
        return
    module.__dict__.pop("forward", None)  # the class's forward again
    if enabled:
        plain = module.forward

        def forward(*args, **kwargs):
            return gradient_checkpoint_forward(plain, True, offload, *args, **kwargs)

        module.forward = forward
    module._difftune_whole_ckpt = state
