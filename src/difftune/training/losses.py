"""Training losses. Each draws its randomness from a generator derived from (seed, epoch, sample index).

Never from the data and never from global RNG state: so one-stage and two-stage training, one process
or several, with or without gradient accumulation, draw the same noise and timesteps for the same sample.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any

import torch

from ..core.loss import Loss, as_loss
from ..errors import UserError


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A CPU generator for one sample visit, independent of process, batch layout and stage."""
    digest = hashlib.sha256(f"difftune:{seed}:{epoch}:{index}".encode()).digest()
    return torch.Generator("cpu").manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _per_sample_noise(shape_like: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    return torch.stack([torch.randn(shape_like.shape[1:], generator=g, dtype=torch.float32) for g in generators])


# Names each loss reads from the values besides what model_fn reads (the split analysis needs them).
SFT_READS = ("input_latents",)
DIRECT_DISTILL_READS = ("input_latents", "latents", "num_inference_steps", "height", "width")


def flow_match_sft_loss(pipe, values: dict[str, Any], generators: Sequence[torch.Generator],
                        settings: dict[str, Any]) -> torch.Tensor:
    """Flow-matching supervised loss: predict the velocity noise - x0 at a random timestep per sample."""
    x0 = values["input_latents"]
    if x0 is None:
        raise ValueError("the sft loss needs input_latents: the data must have an image")
    pipe.stream.check_positions(pipe, x0)
    scheduler = pipe.scheduler
    draws = [scheduler.sample_training(1, g, image_seq_len=pipe.stream.seq_len(x0)) for g in generators]
    noise = _per_sample_noise(x0, generators).to(device=x0.device, dtype=x0.dtype)
    sigma = torch.cat([d[0] for d in draws]).to(x0.device)
    timestep = torch.cat([d[1] for d in draws]).to(x0.device)
    weight = torch.cat([d[2] for d in draws]).to(x0.device)
    noisy = scheduler.add_noise(x0, noise, sigma)
    target = scheduler.training_target(x0, noise)
    pred = pipe.model_fn(latents=noisy, timestep=timestep, **pipe.model_fn_kwargs(values), **settings)
    error = (pred.float() - target.float()).pow(2)
    mask = pipe.stream.loss_mask(pipe, values)
    if mask is None:
        per_sample = error.flatten(1).mean(1)
    else:  # only the elements the family says count (e.g. not a clean first frame), per sample
        mask = mask.to(error.device, error.dtype).expand_as(error)
        per_sample = (error * mask).flatten(1).sum(1) / mask.flatten(1).sum(1).clamp(min=1)
    return (per_sample * weight.float()).mean()


def direct_distill_loss(pipe, values: dict[str, Any], generators: Sequence[torch.Generator],
                        settings: dict[str, Any]) -> torch.Tensor:
    """The reference's direct distillation: sample for the metadata's `num_inference_steps` from the
    seeded noise (cfg 1) with gradients through every step, MSE against the teacher image's latents. The
    sampling is the pipeline's own (its timesteps and denoising loop), as inference runs it."""
    target = values["input_latents"]
    steps = values.get("num_inference_steps")
    if isinstance(steps, (list, tuple)):  # one per sample: the batch samples in lockstep, so they must agree
        if len(set(steps)) > 1:
            raise UserError(f"direct_distill: the samples of one batch ask for different num_inference_steps "
                            f"{sorted(set(steps))}; batch them apart (the pipeline's input_batching) or use batch 1")
        steps = steps[0]
    steps = int(steps if steps is not None else 4)
    pipe.set_timesteps(values, steps)
    latents = pipe.denoise(values, cfg_scale=1.0, progress=False, settings=settings)
    return torch.nn.functional.mse_loss(latents.float(), target.float())


LOSSES = {"sft": Loss(flow_match_sft_loss, SFT_READS), "direct_distill": Loss(direct_distill_loss, DIRECT_DISTILL_READS)}
# Data columns a loss accepts without reading them, and why (said once as a note, instead of refused as unread):
# the reference's distillation data records the teacher's guidance; its loss samples the student at cfg 1.
UNREAD_INPUTS = {"direct_distill": {"cfg_scale": "direct_distill trains the student at cfg 1 (as the reference); "
                                                 "the metadata's cfg_scale (the teacher's guidance) is not used"}}


def all_losses() -> dict[str, Loss]:
    """The shared losses and every registered family's own (FamilySpec.losses), by task name."""
    from ..core.family import families

    table = dict(LOSSES)
    for spec in families().values():
        for name, entry in dict(getattr(spec, "losses", {}) or {}).items():
            table.setdefault(name, as_loss(entry))
    return table
