"""Training losses. Each draws its randomness from a generator derived from (seed, epoch, sample index).

Never from the data and never from global RNG state: so one-stage and two-stage training, one process
or several, with or without gradient accumulation, draw the same noise and timesteps for the same sample.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ..core.loss import Loss, as_loss
from ..errors import UserError


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    """A CPU generator for one sample visit, independent of process, batch layout and stage."""
    digest = hashlib.sha256(f"difftune:{seed}:{epoch}:{index}".encode()).digest()
    return torch.Generator("cpu").manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def per_sample_noise(shape_like: torch.Tensor, generators: Sequence[torch.Generator]) -> torch.Tensor:
    return torch.stack([torch.randn(shape_like.shape[1:], generator=g, dtype=torch.float32) for g in generators])


# Names each loss reads from the values besides what model_fn reads (the split analysis needs them); a target's
# other streams add their own clean latents (`stream_reads`).
SFT_READS = ("input_latents",)
DIRECT_DISTILL_READS = ("input_latents", "latents", "num_inference_steps", "height", "width")


def flow_match_sft_loss(pipe, values: dict[str, Any], generators: Sequence[torch.Generator],
                        settings: dict[str, Any]) -> torch.Tensor:
    """The supervised loss of every stream of the family's target: each stream's clean latents noised at a timestep
    drawn per sample (one draw per scheduler: streams that share one share the timestep), the denoiser's prediction
    against the target of the prediction type (flow: noise - x0; epsilon: the noise; v: the velocity), a masked mean
    squared error per sample weighted by the draw, summed over the streams. Each sample's draws come from its own
    generator, in stream order: the timestep, then each stream's noise."""
    streams = pipe.target.streams
    clean = {}
    for stream in streams:
        x0 = values.get(stream.input_latents)
        if x0 is None:
            raise ValueError(f"the sft loss needs {stream.input_latents}: the data must have {stream.what}")
        stream.check_positions(pipe, x0)
        clean[stream.name] = x0
    draws, inputs, targets = {}, {}, {}
    for stream in streams:
        x0, scheduler = clean[stream.name], pipe.scheduler_of(stream)
        check_prediction(pipe, scheduler)
        if id(scheduler) not in draws:
            drawn = [scheduler.sample_training(1, g, image_seq_len=stream.seq_len(x0)) for g in generators]
            draws[id(scheduler)] = [torch.cat([d[k] for d in drawn]).to(x0.device) for k in range(3)]
            inputs[pipe.timestep_name(stream)] = draws[id(scheduler)][1]
        point, _, weight = draws[id(scheduler)]
        noise = per_sample_noise(x0, generators).to(device=x0.device, dtype=x0.dtype)
        offset = getattr(scheduler, "training_noise", None)  # kohya's noise offset (epsilon / v schedulers)
        if offset is not None:
            noise = offset(noise, generators)
        inputs[stream.latents] = scheduler.add_noise(x0, noise, point)
        targets[stream.name] = (scheduler.training_target(x0, noise, point), weight)
    pred = pipe.model_fn(**inputs, **pipe.model_fn_kwargs(values), **settings)
    preds = pred if isinstance(pred, Mapping) else {streams[0].name: pred}
    total, parts = 0, {}
    for stream in streams:
        target, weight = targets[stream.name]
        error = (preds[stream.name].float() - target.float()).pow(2)
        mask = stream.loss_mask(pipe, values)
        if mask is None:
            per_sample = error.flatten(1).mean(1)
        else:  # only the elements the family says count (e.g. not a clean first frame), per sample
            mask = mask.to(error.device, error.dtype).expand_as(error)
            per_sample = (error * mask).flatten(1).sum(1) / mask.flatten(1).sum(1).clamp(min=1)
        parts[stream.name] = (per_sample * weight.float()).mean()
        total = total + parts[stream.name]
    if len(streams) > 1:  # each stream's part, logged beside the total (training/loop.py StreamLosses)
        pipe.stream_losses = {k: v.detach() for k, v in parts.items()}
    return total


def check_prediction(pipe, scheduler) -> None:
    """The scheduler trains what the target's denoiser predicts (a flow scheduler on an epsilon model would train
    it on the wrong target without a word)."""
    predicts = getattr(scheduler, "prediction", "flow")
    if predicts != pipe.target.prediction:
        raise UserError(f"{type(pipe).__name__} predicts {pipe.target.prediction}, but its scheduler "
                        f"({type(scheduler).__name__}) trains {predicts}")


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


def all_losses(family=None) -> dict[str, Loss]:
    """The losses by task name: the shared ones and every registered family's own (FamilySpec.losses); a family's
    loss of a shared task's name (e.g. an audio + video family's sft) stands in for it in that family's runs."""
    from ..core.family import families

    table = dict(LOSSES)
    for spec in families().values():
        for name, entry in dict(getattr(spec, "losses", {}) or {}).items():
            if name not in LOSSES:
                table.setdefault(name, as_loss(entry))
    if family is not None:
        table.update({name: as_loss(entry) for name, entry in dict(family.losses or {}).items()})
    return table
