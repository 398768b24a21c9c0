"""LTX-2's sft loss (the reference's `FlowMatchSFTAudioVideoLoss`): one timestep for both streams, each noised with
its own noise, the flow matched per stream and the two mean squared errors summed, each weighted by the draw.

A clip without sound trains the video stream alone, as the reference's no-audio script does: the DiT still sees a
sound stream, of pure noise at the drawn timestep (the reference feeds its initial noise), and no audio loss is
taken. The draws of a sample come from its own generator, in the order timestep, video noise, audio noise: the
shared sft loss's order, so a clip with sound draws what it would draw there."""

from __future__ import annotations

import torch

from ...core.loss import Loss
from ...training.losses import per_sample_noise, check_prediction


def _mse(pred, target, weight):
    return ((pred.float() - target.float()).pow(2).flatten(1).mean(1) * weight.float()).mean()


def ltx2_sft_loss(pipe, values, generators, settings):
    video, audio = pipe.target.streams
    x0, a0 = values["input_latents"], values.get("audio_input_latents")
    scheduler = pipe.scheduler
    check_prediction(pipe, scheduler)
    drawn = [scheduler.sample_training(1, g, image_seq_len=video.seq_len(x0)) for g in generators]
    point, timestep, weight = (torch.cat([d[k] for d in drawn]).to(x0.device) for k in range(3))
    noise = per_sample_noise(x0, generators).to(x0.device, x0.dtype)
    inputs = {"latents": scheduler.add_noise(x0, noise, point), "timestep": timestep}
    if a0 is not None:
        audio_noise = per_sample_noise(a0, generators).to(a0.device, a0.dtype)
        inputs["audio_latents"] = scheduler.add_noise(a0, audio_noise, point)
    else:
        frames = (int(x0.shape[2]) - 1) * video.temporal + 1
        rate = values.get("frame_rate")
        rate = float(rate.reshape(-1)[0]) if isinstance(rate, torch.Tensor) else \
            float((rate[0] if isinstance(rate, (list, tuple)) else rate) or settings.get("run_frame_rate") or 24)
        shape = audio.noise_shape(pipe, num_frames=frames, frame_rate=rate)
        inputs["audio_latents"] = torch.stack([torch.randn(shape, generator=g) for g in generators]).to(
            x0.device, x0.dtype)
    pred = pipe.model_fn(**inputs, **pipe.model_fn_kwargs(values), **settings)
    parts = {"video": _mse(pred["video"], scheduler.training_target(x0, noise, point), weight)}
    if a0 is not None:
        parts["audio"] = _mse(pred["audio"], scheduler.training_target(a0, audio_noise, point), weight)
    pipe.stream_losses = {k: v.detach() for k, v in parts.items()}
    return sum(parts.values())


LOSSES = {"sft": Loss(ltx2_sft_loss, ("input_latents", "audio_input_latents", "frame_rate"))}

__all__ = ["LOSSES", "ltx2_sft_loss"]
