"""ε- and v-prediction: DDPM's forward process for training and DDIM steps for sampling, on diffusers' own schedulers
(`DDPMScheduler.add_noise` / `get_velocity`, `DDIMScheduler.step`), so the alphas, the noised latents and every step
are diffusers' numbers. The SNR of each timestep is at hand for a loss that weighs by it (min-SNR)."""

from __future__ import annotations

import torch

from ..errors import UserError

# What a UNet repository's scheduler_config.json leaves out means diffusers' defaults; these are SD 1.5's.
SD_DEFAULTS = {"num_train_timesteps": 1000, "beta_start": 0.00085, "beta_end": 0.012, "beta_schedule": "scaled_linear",
               "clip_sample": False, "set_alpha_to_one": False, "steps_offset": 1}
PREDICTIONS = {"epsilon": "epsilon", "v_prediction": "v_prediction"}
_DDIM_KEYS = ("num_train_timesteps", "beta_start", "beta_end", "beta_schedule", "trained_betas", "clip_sample",
              "set_alpha_to_one", "steps_offset", "prediction_type", "thresholding", "timestep_spacing",
              "rescale_betas_zero_snr")
_DDPM_KEYS = ("num_train_timesteps", "beta_start", "beta_end", "beta_schedule", "trained_betas", "clip_sample",
              "prediction_type", "thresholding", "timestep_spacing", "steps_offset", "rescale_betas_zero_snr")


class DiffusionScheduler:
    """Training draws a timestep uniformly from [0, num_train_timesteps) per sample (as diffusers' and kohya's
    scripts); sampling runs DDIM (eta 0) over `set_timesteps`."""

    def __init__(self, prediction: str = "epsilon", **config):
        from diffusers import DDIMScheduler, DDPMScheduler

        if prediction not in PREDICTIONS:
            raise ValueError(f"DiffusionScheduler predicts epsilon or v_prediction, not {prediction!r}")
        given = {k: v for k, v in config.items() if not k.startswith("_")}
        self.prediction = prediction
        self.config = {**SD_DEFAULTS, **given, "prediction_type": prediction}
        self.train = DDPMScheduler(**{k: v for k, v in self.config.items() if k in _DDPM_KEYS})
        self.sampler = DDIMScheduler(**{k: v for k, v in self.config.items() if k in _DDIM_KEYS})
        self.num_train_timesteps = int(self.config["num_train_timesteps"])
        self.training = False
        self.timesteps = torch.zeros(0, dtype=torch.long)
        self.sigmas = torch.zeros(0)  # no sigmas: validation saves and restores them with the timesteps

    # -- training -------------------------------------------------------------------------------------
    def set_training(self, image_seq_len=None, *, timestep_sampling=None, shift=None, weighting=None, sampling=None,
                     boundaries=(0.0, 1.0), **_):
        """Switch to training: uniform timesteps over [int(min * n), int(max * n)) of the boundaries; the flow
        flags (logit-normal sampling, a dynamic shift, bell weighting) have no meaning here and are refused."""
        if (timestep_sampling or sampling or "uniform") != "uniform":
            raise UserError("--timestep_sampling: an epsilon / v-prediction model draws its timesteps uniformly")
        if (shift or "fixed") != "fixed":
            raise UserError("--timestep_shift: an epsilon / v-prediction model has no time shift")
        lo, hi = (float(b) for b in boundaries)
        if not 0 <= lo < hi <= 1:
            raise UserError(f"--min/--max_timestep_boundary must satisfy 0 <= min < max <= 1, got {lo}, {hi}")
        self.boundaries = (lo, hi)
        self.training = True

    def sample_training(self, batch_size: int, generator: torch.Generator, image_seq_len=None):
        """(timesteps as the noising takes them, timesteps as the model takes them, weights of 1)."""
        lo, hi = (int(b * self.num_train_timesteps) for b in self.boundaries)
        t = torch.randint(lo, max(hi, lo + 1), (batch_size,), generator=generator)
        return t, t, torch.ones(batch_size)

    def add_noise(self, x0: torch.Tensor, noise: torch.Tensor, t) -> torch.Tensor:
        t = torch.as_tensor(t, dtype=torch.long).reshape(-1)
        return self.train.add_noise(x0.float(), noise.float(), t.to(x0.device)).to(x0.dtype)

    def training_target(self, x0: torch.Tensor, noise: torch.Tensor, t=None) -> torch.Tensor:
        """The noise (epsilon) or the velocity sqrt(a) * noise - sqrt(1 - a) * x0 (v_prediction)."""
        if self.prediction == "epsilon":
            return noise
        t = torch.as_tensor(t, dtype=torch.long).reshape(-1)
        return self.train.get_velocity(x0.float(), noise.float(), t.to(x0.device)).to(x0.dtype)

    def snr(self, t) -> torch.Tensor:
        """alpha_bar / (1 - alpha_bar) at these timesteps (a min-SNR weighting's input)."""
        a = self.train.alphas_cumprod[torch.as_tensor(t, dtype=torch.long).reshape(-1)]
        return a / (1 - a)

    # -- sampling -------------------------------------------------------------------------------------
    def set_timesteps(self, num_inference_steps: int, *, denoising_strength: float = 1.0, **_):
        """DDIM's timesteps; image-to-image starts `denoising_strength` of the way in (diffusers' img2img)."""
        self.sampler.set_timesteps(int(num_inference_steps))
        steps = self.sampler.timesteps
        keep = min(int(num_inference_steps * float(denoising_strength)), len(steps))
        self.timesteps = steps[len(steps) - keep:]
        self.sigmas = torch.zeros(len(self.timesteps) + 1)
        self.training = False
        return self.timesteps

    def step(self, model_output: torch.Tensor, step_index: int, sample: torch.Tensor) -> torch.Tensor:
        return self.sampler.step(model_output, self.timesteps[step_index], sample, eta=0.0).prev_sample

    def start_latents(self, input_latents, noise):
        """Image-to-image: the clean latents noised to the first timestep."""
        return self.add_noise(input_latents, noise, self.timesteps[:1])


def scheduler_for(prediction: str, config, training_mu: float | None = None, training_sigma_min: float | None = None):
    """The scheduler of a target's prediction type from its scheduler config."""
    if prediction == "flow":
        from .flow_match import FlowMatchScheduler

        return FlowMatchScheduler(training_mu=training_mu, training_sigma_min=training_sigma_min, **dict(config))
    return DiffusionScheduler(prediction, **dict(config))


__all__ = ["DiffusionScheduler", "scheduler_for"]
