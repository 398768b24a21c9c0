"""Flow-matching scheduler: Qwen-Image's inference sigmas, and a training mode.

Inference follows the official Qwen-Image scheduler config (diffusers' FlowMatchEulerDiscreteScheduler
with `use_dynamic_shifting`, exponential time shift, `shift_terminal=0.02`) and QwenImagePipeline's
schedule (`sigmas = linspace(1, 1/N, N)`, mu from the image sequence length). Training draws one timestep
per sample from a caller's generator; formulas and reasons are in docs/scheduler.md.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

QWEN_IMAGE_CONFIG = {
    "base_image_seq_len": 256, "max_image_seq_len": 8192, "base_shift": 0.5, "max_shift": 0.9,
    "num_train_timesteps": 1000, "shift": 1.0, "shift_terminal": 0.02, "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}
TRAINING_MU = 0.8  # the reference's fixed training shift for Qwen-Image


def calculate_shift(image_seq_len: float, base_seq_len=256, max_seq_len=8192, base_shift=0.5, max_shift=0.9) -> float:
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    return image_seq_len * m + (base_shift - m * base_seq_len)


class FlowMatchScheduler:
    def __init__(self, **config):
        self.config = {**QWEN_IMAGE_CONFIG, **{k: v for k, v in config.items() if not k.startswith("_")}}
        self.training = False
        self.sampling, self.shift_mode, self.weighting = "uniform", "fixed", "bell"
        self.sigmas = torch.zeros(0)
        self.timesteps = torch.zeros(0)

    @classmethod
    def from_config(cls, config: dict) -> FlowMatchScheduler:
        return cls(**config)

    @classmethod
    def from_pretrained(cls, path: str) -> FlowMatchScheduler:
        p = Path(path)
        p = p / "scheduler_config.json" if p.is_dir() else p
        return cls(**json.loads(p.read_text()))

    # -- shared maths ---------------------------------------------------------------------------------
    def mu(self, image_seq_len: float) -> float:
        c = self.config
        return calculate_shift(image_seq_len, c["base_image_seq_len"], c["max_image_seq_len"], c["base_shift"],
                               c["max_shift"])

    def shift_sigmas(self, sigmas: np.ndarray, mu: float | None) -> np.ndarray:
        c = self.config
        if c.get("use_dynamic_shifting"):
            if c.get("time_shift_type", "exponential") == "exponential":
                sigmas = math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1))
            else:
                sigmas = mu / (mu + (1 / sigmas - 1))
        else:
            s = c.get("shift", 1.0)
            sigmas = s * sigmas / (1 + (s - 1) * sigmas)
        if c.get("shift_terminal"):
            one_minus = 1 - sigmas
            sigmas = 1 - one_minus / (one_minus[-1] / (1 - c["shift_terminal"]))
        return sigmas

    # -- inference ------------------------------------------------------------------------------------
    def set_timesteps(self, num_inference_steps: int, *, image_seq_len: float, denoising_strength: float = 1.0):
        """Sigmas (N+1, ending in 0) and timesteps (N) for N steps; with strength < 1 the first steps are
        dropped (image-to-image starts part-way, as diffusers' img2img pipeline does)."""
        n = int(num_inference_steps)
        sigmas = np.linspace(1.0, 1 / n, n)
        sigmas = self.shift_sigmas(sigmas, self.mu(image_seq_len)).astype(np.float32)
        sigmas = torch.from_numpy(sigmas).float()
        start = int(max(n - min(n * denoising_strength, n), 0))
        sigmas = sigmas[start:]
        self.sigmas = torch.cat([sigmas, torch.zeros(1)])
        self.timesteps = sigmas * self.config["num_train_timesteps"]
        return self.timesteps

    def step(self, model_output: torch.Tensor, step_index: int, sample: torch.Tensor) -> torch.Tensor:
        """One Euler step of the velocity ODE, computed in fp32 like diffusers."""
        dt = self.sigmas[step_index + 1] - self.sigmas[step_index]
        return (sample.float() + dt * model_output.float()).to(model_output.dtype)

    # -- training -------------------------------------------------------------------------------------
    def set_training(self, sampling: str = "uniform", shift: str = "fixed", weighting: str = "bell") -> None:
        self.training = True
        self.sampling, self.shift_mode, self.weighting = sampling, shift, weighting
        self._tables: dict[float, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def training_table(self, mu: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The 1000-entry training table for shift `mu`: sigmas, timesteps and loss weights (mean 1)."""
        if mu not in self._tables:
            n = self.config["num_train_timesteps"]
            sigmas = self.shift_sigmas(np.linspace(1.0, 0.0, n + 1)[:-1], mu)
            sigmas = torch.from_numpy(sigmas).float()
            timesteps = sigmas * n
            self._tables[mu] = (sigmas, timesteps, self._bell(timesteps))
        return self._tables[mu]

    def _bell(self, timesteps: torch.Tensor) -> torch.Tensor:
        n = self.config["num_train_timesteps"]
        y = torch.exp(-2 * ((timesteps - n / 2) / n) ** 2)
        y = y - y.min()
        return y * (len(y) / y.sum())

    def sample_training(self, batch_size: int, generator: torch.Generator, image_seq_len: float | None = None):
        """(sigma, timestep, weight), each (batch_size,), drawn only from `generator`."""
        mu = self.mu(image_seq_len) if (self.shift_mode == "dynamic" and image_seq_len) else TRAINING_MU
        sigmas, timesteps, weights = self.training_table(mu)
        if self.sampling == "logit_normal":
            u = torch.sigmoid(torch.randn(batch_size, generator=generator)).clamp(1e-4, 1 - 1e-4)
            # inverse-CDF lookup into the (decreasing) table keeps the same shift and weights
            idx = ((1 - u) * len(sigmas)).long().clamp(0, len(sigmas) - 1)
        else:
            idx = torch.randint(0, len(sigmas), (batch_size,), generator=generator)
        weight = weights[idx] if self.weighting == "bell" else torch.ones(batch_size)
        return sigmas[idx], timesteps[idx], weight

    @staticmethod
    def add_noise(x0: torch.Tensor, noise: torch.Tensor, sigma) -> torch.Tensor:
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x0.device)
        sigma = sigma.view(-1, *([1] * (x0.dim() - 1))) if sigma.dim() else sigma
        return ((1 - sigma) * x0.float() + sigma * noise.float()).to(x0.dtype)

    @staticmethod
    def training_target(x0: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
        return noise - x0
