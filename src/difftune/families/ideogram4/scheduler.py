"""Ideogram-4's schedule: sigmas from a logit-normal distribution whose mean moves with the image's size (diffusers'
Ideogram4Pipeline and the reference's `set_timesteps_ideogram4` agree on it), on the shared flow-matching scheduler.

sigma_i = 1 - clamp(1 - expit(mean + std * ndtri(s_i))), s = linspace(0, strength, N + 1), read from the noise end,
the last (sigma ~ 0) left out and a 0 appended; mean = mu + log(pixels / 512^2) / 2, mu = 0, std = 1.5. The clamp
keeps the log-SNR in [-15, 18]. Training draws from the reference's 1000-entry table of the same schedule at
1024 x 1024 (its training default), with the bell weights; `--timestep_shift dynamic` uses each sample's size.
"""

from __future__ import annotations

import math

import torch

from ...schedulers.flow_match import FlowMatchScheduler, bell_weights

BASE_PIXELS = 512 * 512
TRAINING_PIXELS = 1024 * 1024  # the reference's training table (image_resolution's default)
PIXELS_PER_TOKEN = 16 * 16  # VAE x8, 2x2 patches
MU, STD = 0.0, 1.5
LOGSNR_MIN, LOGSNR_MAX = -15.0, 18.0


def schedule_mean(pixels: float, mu: float = MU) -> float:
    return mu + 0.5 * math.log(pixels / BASE_PIXELS)


def logit_normal_sigmas(steps: int, mean: float, std: float = STD, strength: float = 1.0) -> torch.Tensor:
    """`steps` decreasing sigmas in float32 (no final 0), computed in float64 as diffusers does."""
    intervals = torch.linspace(0.0, strength, steps + 1, dtype=torch.float64)
    t = 1.0 - torch.special.expit(mean + std * torch.special.ndtri(intervals))
    t = t.clamp(1.0 / (1.0 + math.exp(0.5 * LOGSNR_MAX)), 1.0 / (1.0 + math.exp(0.5 * LOGSNR_MIN)))
    return (1.0 - t).flip(0)[:-1].to(torch.float32)


class Ideogram4Scheduler(FlowMatchScheduler):
    """The flow-matching Euler scheduler on Ideogram-4's logit-normal sigmas (`mu`, `std`: the schedule's base mean
    and spread)."""

    def __init__(self, mu: float = MU, std: float = STD, **config):
        super().__init__(**config)
        self.schedule_mu, self.schedule_std = float(mu), float(std)

    def mu(self, image_seq_len: float) -> float:
        """The schedule's mean for an image of `image_seq_len` tokens (16 x 16 pixels each)."""
        return schedule_mean(image_seq_len * PIXELS_PER_TOKEN, self.schedule_mu)

    def set_timesteps(self, num_inference_steps: int, *, image_seq_len: float | None = None,
                      denoising_strength: float = 1.0, mu: float | None = None, strength_mode: str = "diffsynth"
                      ) -> torch.Tensor:
        """N steps of the schedule for `image_seq_len` tokens (or the mean `mu`); a strength below 1 runs all N steps
        over the first `strength` of the schedule's quantiles, as the reference does."""
        n = int(num_inference_steps)
        if n < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
        if not 0.0 < float(denoising_strength) <= 1.0:
            raise ValueError(f"denoising_strength must be in (0, 1], got {denoising_strength}")
        if mu is None:
            if image_seq_len is None:
                raise ValueError("Ideogram-4's schedule depends on the image size: pass image_seq_len (or mu)")
            mu = self.mu(image_seq_len)
        sigmas = logit_normal_sigmas(n, mu, self.schedule_std, float(denoising_strength))
        self.timesteps = sigmas * self.num_train_timesteps
        self.sigmas = torch.cat([sigmas, torch.zeros(1)])
        return self.timesteps

    def training_table(self, mu: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        key = schedule_mean(TRAINING_PIXELS, self.schedule_mu) if mu is None else float(mu)
        if key not in self._tables:
            n = self.num_train_timesteps
            sigmas = logit_normal_sigmas(n, key, self.schedule_std)
            timesteps = sigmas * n
            self._tables[key] = (sigmas, timesteps, bell_weights(timesteps, n))
        return self._tables[key]

    def training_mu(self, image_seq_len: float | None = None) -> float | None:
        if self.shift_mode == "fixed":
            return None  # the reference's table (1024 x 1024)
        seq = image_seq_len if image_seq_len is not None else self.train_image_seq_len
        if seq is None:
            raise ValueError("--timestep_shift dynamic needs the image sequence length of the sample")
        return self.mu(seq)


__all__ = ["Ideogram4Scheduler", "logit_normal_sigmas", "schedule_mean"]
