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
                     boundaries=(0.0, 1.0), noise_offset: float = 0.0, noise_offset_random_strength: bool = False,
                     min_snr_gamma: float | None = None, debiased_estimation_loss: bool = False,
                     min_timestep: int | None = None, max_timestep: int | None = None, **_):
        """Switch to training: uniform timesteps over [int(min * n), int(max * n)) of the boundaries (or kohya's
        [min_timestep, max_timestep)); the flow flags (logit-normal sampling, a dynamic shift, bell weighting) have no
        meaning here and are refused. kohya's noise offset, min-SNR and debiased weightings apply to each sample."""
        if (timestep_sampling or sampling or "uniform") != "uniform":
            raise UserError("--timestep_sampling: an epsilon / v-prediction model draws its timesteps uniformly")
        if (shift or "fixed") != "fixed":
            raise UserError("--timestep_shift: an epsilon / v-prediction model has no time shift")
        lo, hi = (float(b) for b in boundaries)
        if not 0 <= lo < hi <= 1:
            raise UserError(f"--min/--max_timestep_boundary must satisfy 0 <= min < max <= 1, got {lo}, {hi}")
        n = self.num_train_timesteps
        steps = (int(lo * n), max(int(hi * n), int(lo * n) + 1))
        if min_timestep is not None or max_timestep is not None:
            if (lo, hi) != (0.0, 1.0):
                raise UserError("--min_timestep / --max_timestep and --min/--max_timestep_boundary say the same "
                                "thing two ways: give one")
            steps = (0 if min_timestep is None else int(min_timestep), n if max_timestep is None else int(max_timestep))
            if not 0 <= steps[0] < steps[1] <= n:
                raise UserError(f"--min_timestep {steps[0]} / --max_timestep {steps[1]}: 0 <= min < max <= {n} "
                                f"is needed")
        if not (noise_offset == noise_offset and noise_offset >= 0):  # NaN or negative
            raise UserError(f"--noise_offset {noise_offset}: a number >= 0 is needed")
        if noise_offset_random_strength and not noise_offset:
            raise UserError("--noise_offset_random_strength scales --noise_offset, which is not set")
        if min_snr_gamma is not None and not min_snr_gamma > 0:
            raise UserError(f"--min_snr_gamma {min_snr_gamma}: a number > 0 is needed (5 is usual)")
        self.steps, self.boundaries = steps, (lo, hi)
        self.noise_offset, self.noise_offset_random = float(noise_offset), bool(noise_offset_random_strength)
        self.min_snr_gamma, self.debiased = min_snr_gamma, bool(debiased_estimation_loss)
        self.training = True

    def sample_training(self, batch_size: int, generator: torch.Generator, image_seq_len=None):
        """(timesteps as the noising takes them, timesteps as the model takes them, each sample's loss weight: 1, or
        kohya's min-SNR and / or debiased weights)."""
        lo, hi = getattr(self, "steps", (0, self.num_train_timesteps))
        t = torch.randint(lo, hi, (batch_size,), generator=generator)
        return t, t, self.loss_weight(t)

    def loss_weight(self, t) -> torch.Tensor:
        """kohya's weights at these timesteps: min-SNR min(SNR, gamma) / SNR (v: / (SNR + 1)), debiased
        1 / sqrt(min(SNR, 1000)) (v: of SNR + 1); 1 without either."""
        weight = torch.ones(len(t))
        if getattr(self, "min_snr_gamma", None) is None and not getattr(self, "debiased", False):
            return weight
        snr = self.snr(t).double()
        v = self.prediction == "v_prediction"
        if self.min_snr_gamma is not None:
            weight = weight * (snr.clamp(max=self.min_snr_gamma) / (snr + 1 if v else snr)).float()
        if self.debiased:
            snr_t = snr.clamp(max=1000)
            weight = weight * (1 / (snr_t + 1 if v else snr_t).sqrt()).float()
        return weight

    def training_noise(self, noise: torch.Tensor, generators) -> torch.Tensor:
        """kohya's noise offset: per sample one normal value per channel (times a uniform strength with
        --noise_offset_random_strength), drawn from the sample's generator after its noise."""
        if not getattr(self, "noise_offset", 0.0):
            return noise
        offsets = []
        for g in generators:
            strength = self.noise_offset * (torch.rand(1, generator=g).item() if self.noise_offset_random else 1.0)
            offsets.append(strength * torch.randn(noise.shape[1], generator=g))
        shape = (noise.shape[0], noise.shape[1]) + (1,) * (noise.dim() - 2)
        return noise + torch.stack(offsets).reshape(shape).to(device=noise.device, dtype=noise.dtype)

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
