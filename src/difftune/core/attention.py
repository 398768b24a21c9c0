"""Attention in training: which kernel diffusers' attention dispatcher runs (`--attention_backend`), and no padding mask
where nothing is padded (a mask rules out the flash kernels and costs SDPA a slower path).

The backend is diffusers' (`diffusers.models.attention_dispatch`): the models' attention processors call
`dispatch_attention_fn`, which runs the active backend; a training run runs under `attention_backend(...)` (forward
and the recomputed forward of gradient checkpointing alike). The flash and sage kernels take no mask: `auto` picks
them only where none is left (batch size 1 from a stage-1 cache, whose masks are looked at in host memory).
"""

from __future__ import annotations

import contextlib

import torch

from ..errors import UserError

# --attention_backend -> diffusers' AttentionBackendName value
BACKENDS = {"native": "native", "flash": "flash", "flash3": "_flash_3", "sage": "sage", "cudnn": "_native_cudnn",
            "efficient": "_native_efficient", "math": "_native_math", "xformers": "xformers", "flex": "flex"}
CHOICES = ("auto", *BACKENDS)
CUDA_ONLY = {"flash", "flash3", "sage", "cudnn", "efficient", "xformers"}
NO_MASK = {"flash", "flash3", "sage"}
DROP_UNPADDED_MASKS = True  # off: masks are passed as built (benchmarks/host_overhead.py's "before")


def _usable(name: str) -> str | None:
    """None when diffusers can run backend `name` here, else why not (one line)."""
    from diffusers.models.attention_dispatch import AttentionBackendName, _check_attention_backend_requirements

    try:
        _check_attention_backend_requirements(AttentionBackendName(BACKENDS[name]))
    except (RuntimeError, ImportError, ValueError) as e:
        return str(e).split(". ")[0].strip().rstrip(".")
    return None


def resolve_backend(name: str, device, batch_size: int = 1) -> str:
    """`--attention_backend`'s value for `device`: `auto` is the fastest installed (FlashAttention 3 on Hopper, then
    FlashAttention 2, else native SDPA; native on a CPU, and where batches of several prompts may pad); a named backend
    that cannot run here is a UserError."""
    device = torch.device(device)
    if name == "auto":
        if device.type != "cuda" or batch_size > 1:
            return "native"
        order = (["flash3"] if torch.cuda.get_device_capability(device)[0] == 9 else []) + ["flash"]
        return next((b for b in order if _usable(b) is None), "native")
    if name not in BACKENDS:
        raise UserError(f"--attention_backend {name}: unknown (choose from {', '.join(CHOICES)})")
    if name in CUDA_ONLY and device.type != "cuda":
        raise UserError(f"--attention_backend {name}: needs a CUDA GPU (training runs on {device.type}); use native")
    why = _usable(name)
    if why is not None:
        raise UserError(f"--attention_backend {name}: not usable here: {why}")
    return name


def backend_context(name: str):
    """The context training runs under: backend `name` active in diffusers' dispatcher."""
    from diffusers.models.attention_dispatch import attention_backend

    if name == "native":
        return contextlib.nullcontext()  # diffusers' default
    return attention_backend(BACKENDS[name])


def unpadded(mask):
    """None for a padding mask that masks nothing (all true), else the mask. Only a mask in host memory is looked at
    (reading one on a GPU would wait for it)."""
    if (DROP_UNPADDED_MASKS and isinstance(mask, torch.Tensor) and mask.device.type == "cpu"
            and bool(mask.all())):
        return None
    return mask
