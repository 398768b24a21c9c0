"""Flow-matching scheduler: inference sigmas identical to diffusers' FlowMatchEulerDiscreteScheduler, and a training mode.

Inference reproduces what diffusers' pipelines (Qwen-Image's first) feed `FlowMatchEulerDiscreteScheduler`: sigmas
`linspace(1, 1/N, N)`, the time shift (exponential, mu from the image sequence length when
`use_dynamic_shifting`), the `shift_terminal` stretch, timesteps = sigmas * 1000, and a final 0 sigma.
The arithmetic follows diffusers' dtype path (float32 numpy) so the numbers are bit-identical.

Training draws one timestep per sample from a caller's `torch.Generator`; by default from the same
distribution as DiffSynth-Studio (docs/scheduler.md has the formulas and the reasons).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import torch

from ..errors import UserError

# diffusers' FlowMatchEulerDiscreteScheduler defaults: what a config that leaves a key out means.
DIFFUSERS_DEFAULTS = {
    "num_train_timesteps": 1000, "shift": 1.0, "use_dynamic_shifting": False, "base_shift": 0.5,
    "max_shift": 1.15, "base_image_seq_len": 256, "max_image_seq_len": 4096, "invert_sigmas": False,
    "shift_terminal": None, "use_karras_sigmas": False, "use_exponential_sigmas": False, "use_beta_sigmas": False,
    "time_shift_type": "exponential", "stochastic_sampling": False,
}
_UNSUPPORTED = ("invert_sigmas", "use_karras_sigmas", "use_exponential_sigmas", "use_beta_sigmas",
                "stochastic_sampling")
TIMESTEP_SAMPLINGS = ("uniform", "logit_normal")
SHIFTS = ("fixed", "dynamic")
WEIGHTINGS = ("bell", "none")
STRENGTH_MODES = ("diffusers", "diffsynth")


def calculate_shift(image_seq_len: float, base_seq_len: int = 256, max_seq_len: int = 8192,
                    base_shift: float = 0.5, max_shift: float = 0.9) -> float:
    """mu, linear in the image sequence length (as diffusers' Qwen-Image pipeline computes it)."""
    m = (max_shift - base_shift) / (max_seq_len - base_seq_len)
    b = base_shift - m * base_seq_len
    return image_seq_len * m + b


class FlowMatchScheduler:
    """Flow-matching Euler scheduler from a scheduler_config.json's values (diffusers' defaults for what it
    leaves out); each family passes its own (e.g. `QwenImagePipeline.default_scheduler()`).

    `training_mu` is the fixed time shift of the training table for configs with dynamic shifting (the
    reference trains Qwen-Image at 0.8); configs with a static `shift` train at that shift."""

    prediction = "flow"  # what a denoiser it trains predicts (core/target.py)

    def __init__(self, training_mu: float | None = None, training_sigma_min: float | None = None, **config):
        given = {k: v for k, v in config.items() if not k.startswith("_")}
        self.config = {**DIFFUSERS_DEFAULTS, **given}
        self.fixed_training_mu = training_mu
        # the reference's FLUX.1 table keeps a smallest sigma: linspace(1, sigma_min, n) instead of (1, 0, n + 1)[:-1]
        self.training_sigma_min = training_sigma_min
        on = [k for k in _UNSUPPORTED if self.config.get(k)]
        if on:
            raise ValueError(f"FlowMatchScheduler does not implement scheduler options {on}")
        if self.config["time_shift_type"] not in ("exponential", "linear"):
            raise ValueError(f"unknown time_shift_type {self.config['time_shift_type']!r}")
        self.num_train_timesteps = int(self.config["num_train_timesteps"])
        self.training = False
        self.sigmas = torch.zeros(0)
        self.timesteps = torch.zeros(0)
        self.timestep_sampling, self.shift_mode, self.weighting = "uniform", "fixed", "bell"
        self.logit_mean, self.logit_std = 0.0, 1.0
        self.train_image_seq_len: float | None = None
        self.boundaries = (0.0, 1.0)
        self._tables: dict[float, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    @classmethod
    def from_config(cls, config: dict, training_mu: float | None = None) -> FlowMatchScheduler:
        return cls(training_mu=training_mu, **config)

    @classmethod
    def from_pretrained(cls, path: str, training_mu: float | None = None) -> FlowMatchScheduler:
        """From a scheduler_config.json, a folder holding one, or a model repository (its scheduler/)."""
        p = Path(path)
        for candidate in (p, p / "scheduler_config.json", p / "scheduler" / "scheduler_config.json"):
            if candidate.is_file():
                try:
                    config = json.loads(candidate.read_text(encoding="utf-8"))
                except (json.JSONDecodeError, UnicodeDecodeError) as err:
                    raise UserError(f"{candidate}: not a valid scheduler config ({type(err).__name__})") from None
                if not isinstance(config, dict):
                    raise UserError(f"{candidate}: a scheduler config must be a JSON object")
                return cls(training_mu=training_mu, **config)
        raise UserError(f"{path}: no scheduler_config.json there (nor in its scheduler/ folder)")

    # -- shared maths ---------------------------------------------------------------------------------
    def mu(self, image_seq_len: float) -> float:
        c = self.config
        return calculate_shift(image_seq_len, c["base_image_seq_len"], c["max_image_seq_len"], c["base_shift"],
                               c["max_shift"])

    def shift_sigmas(self, sigmas: np.ndarray, mu: float | None) -> np.ndarray:
        """The time shift (dynamic with `mu`, else the static `shift`), then the `shift_terminal` stretch,
        which rescales 1 - sigma so that the last sigma is exactly `shift_terminal`."""
        c = self.config
        if c["use_dynamic_shifting"]:
            if mu is None:
                raise ValueError("this scheduler shifts by image size: pass image_seq_len (or mu)")
            if c["time_shift_type"] == "exponential":
                sigmas = math.exp(mu) / (math.exp(mu) + (1 / sigmas - 1))
            else:
                sigmas = mu / (mu + (1 / sigmas - 1))
        else:
            s = c["shift"]
            sigmas = s * sigmas / (1 + (s - 1) * sigmas)
        if c["shift_terminal"] and float(1 - sigmas[-1]) > 0:  # one step from sigma 1: diffusers gives NaN
            one_minus = 1 - sigmas
            sigmas = 1 - one_minus / (one_minus[-1] / (1 - c["shift_terminal"]))
        return sigmas

    # -- inference ------------------------------------------------------------------------------------
    def set_timesteps(self, num_inference_steps: int, *, image_seq_len: float | None = None,
                      denoising_strength: float = 1.0, mu: float | None = None,
                      strength_mode: str = "diffusers") -> torch.Tensor:
        """Set `sigmas` (steps + 1, ending in 0) and `timesteps` (steps) and return the timesteps.

        `image_seq_len` = (H/16)*(W/16) picks mu (or pass `mu`). With `denoising_strength` < 1:
        "diffusers" (default, diffusers' img2img pipelines) computes the N-step schedule and drops the
        first `int(N - N*strength)` steps; "diffsynth" (DiffSynth-Studio) runs all N steps from a raw
        sigma of `strength`, i.e. `linspace(strength, 0, N+1)[:-1]` before the shift.
        Does not change `training`: a training loss may sample a short schedule mid-run.
        """
        n = int(num_inference_steps)
        if n < 1:
            raise ValueError(f"num_inference_steps must be >= 1, got {num_inference_steps}")
        s = float(denoising_strength)
        if not 0.0 < s <= 1.0:
            raise ValueError(f"denoising_strength must be in (0, 1], got {denoising_strength}")
        if strength_mode not in STRENGTH_MODES:
            raise ValueError(f"strength_mode must be one of {STRENGTH_MODES}, got {strength_mode!r}")
        if mu is None and self.config["use_dynamic_shifting"]:
            if image_seq_len is None:
                raise ValueError("this scheduler shifts by image size: pass image_seq_len (or mu)")
            mu = self.mu(image_seq_len)
        top = s if strength_mode == "diffsynth" else 1.0
        # float64 linspace cast to float32 before shifting: diffusers' exact dtype path.
        raw = np.linspace(top, 0.0, n + 1)[:-1] if strength_mode == "diffsynth" else np.linspace(1.0, 1 / n, n)
        sigmas = torch.from_numpy(np.asarray(self.shift_sigmas(raw.astype(np.float32), mu))).to(torch.float32)
        if strength_mode == "diffusers":
            start = int(max(n - min(n * s, n), 0))  # diffusers' get_timesteps, float quirks included
            sigmas = sigmas[start:]
        self.timesteps = sigmas * self.num_train_timesteps
        self.sigmas = torch.cat([sigmas, torch.zeros(1)])
        return self.timesteps

    def step(self, model_output: torch.Tensor, step_index: int, sample: torch.Tensor) -> torch.Tensor:
        """One Euler step of the velocity ODE, x + (sigma_next - sigma) * v, exactly as diffusers computes it:
        the sample in fp32, dt * v in v's dtype (a 0-dim fp32 dt does not promote a bf16 v), cast back."""
        dt = (self.sigmas[step_index + 1] - self.sigmas[step_index]).to(sample.device)
        return (sample.float() + dt * model_output).to(model_output.dtype)

    @staticmethod
    def add_noise(x0: torch.Tensor, noise: torch.Tensor, sigma) -> torch.Tensor:
        """(1 - sigma) * x0 + sigma * noise; `sigma` is a number or one per batch element."""
        sigma = torch.as_tensor(sigma, dtype=torch.float32, device=x0.device)
        if sigma.dim():
            sigma = sigma.reshape(-1, *([1] * (x0.dim() - 1)))
        return ((1 - sigma) * x0.float() + sigma * noise.float()).to(x0.dtype)

    @staticmethod
    def training_target(x0: torch.Tensor, noise: torch.Tensor, sigma=None) -> torch.Tensor:
        """The velocity d x_sigma / d sigma of the straight path from x0 to noise (at any sigma)."""
        return noise - x0

    # -- training -------------------------------------------------------------------------------------
    def set_training(self, image_seq_len: float | None = None, *, timestep_sampling: str | None = None,
                     shift: str | None = None, weighting: str | None = None, sampling: str | None = None,
                     logit_mean: float = 0.0, logit_std: float = 1.0,
                     boundaries: tuple[float, float] = (0.0, 1.0), **diffusion_options) -> None:
        """Switch to training. Defaults reproduce DiffSynth-Studio (uniform over its 1000-entry table at the
        family's fixed shift, bell weighting). `sampling` is an alias of `timestep_sampling`;
        `image_seq_len` is the default for `shift="dynamic"` when a draw does not give one. `boundaries`
        (min, max) are the reference's --min/--max_timestep_boundary: the draw is uniform over the table's
        entries [int(min * n), int(max * n)) (the table runs from sigma 1 down, so 0.358 at shift 5 is t ~ 900)."""
        if diffusion_options:
            flag = next(iter(diffusion_options))
            raise UserError(f"--{flag}: an option of epsilon / v-prediction models (SD 1.x, SDXL); this family "
                            f"trains flow matching, which has no such noise or SNR")
        options = {"--timestep_sampling": (timestep_sampling or sampling or "uniform", TIMESTEP_SAMPLINGS),
                   "--timestep_shift": (shift or "fixed", SHIFTS),
                   "--loss_weighting": (weighting or "bell", WEIGHTINGS)}
        for flag, (value, allowed) in options.items():
            if value not in allowed:
                raise UserError(f"{flag} must be one of {', '.join(allowed)}; got {value!r}")
        if not logit_std > 0:
            raise UserError(f"the logit-normal std must be > 0, got {logit_std}")
        self.timestep_sampling = options["--timestep_sampling"][0]
        self.shift_mode = options["--timestep_shift"][0]
        self.weighting = options["--loss_weighting"][0]
        self.logit_mean, self.logit_std = float(logit_mean), float(logit_std)
        self.boundaries = _check_boundaries(boundaries, self.num_train_timesteps, self.timestep_sampling)
        self.train_image_seq_len = image_seq_len
        self.training = True

    def training_table(self, mu: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sigmas, timesteps, bell weights) over `num_train_timesteps` entries for shift `mu`:
        sigma = stretch(shift(linspace(1, 0, n + 1)[:-1])), or linspace(1, sigma_min, n) where the family's
        reference keeps a smallest sigma (FLUX.1), decreasing; the weights have mean 1."""
        key = None if mu is None else float(mu)
        if key not in self._tables:
            n = self.num_train_timesteps
            # in float32 arithmetic throughout, as the reference computes its table (float64 rounded once put 601 of
            # Z-Image's 1000 timesteps one float32 step off: docs/reference_differences.md)
            raw = torch.linspace(1.0, 0.0, n + 1, dtype=torch.float32)[:-1] if self.training_sigma_min is None else \
                torch.linspace(1.0, self.training_sigma_min, n, dtype=torch.float32)
            sigmas = torch.as_tensor(self.shift_sigmas(raw, key), dtype=torch.float32)
            timesteps = sigmas * n
            self._tables[key] = (sigmas, timesteps, bell_weights(timesteps, n))
        return self._tables[key]

    def training_mu(self, image_seq_len: float | None = None) -> float:
        if self.shift_mode == "fixed":
            if self.config["use_dynamic_shifting"]:
                if self.fixed_training_mu is None:
                    raise ValueError("this scheduler shifts by image size: give it a training_mu for fixed-shift "
                                     "training (the family's), or train with --timestep_shift dynamic")
                return self.fixed_training_mu
            return None  # a static `shift`: shift_sigmas applies it
        seq = image_seq_len if image_seq_len is not None else self.train_image_seq_len
        if seq is None:
            raise ValueError("--timestep_shift dynamic needs the image sequence length of the sample")
        return self.mu(seq)

    def sample_training(self, batch_size: int, generator: torch.Generator, image_seq_len: float | None = None
                        ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(sigma, timestep, weight), each (batch_size,) float32 on the CPU, drawn only from `generator`."""
        if not isinstance(generator, torch.Generator):
            raise TypeError("sample_training needs a torch.Generator (the global RNG is never used)")
        sigmas, timesteps, weights = self.training_table(self.training_mu(image_seq_len))
        n = len(sigmas)
        if self.timestep_sampling == "logit_normal":
            z = torch.randn(batch_size, generator=generator, device=generator.device).cpu()
            u = torch.sigmoid(self.logit_mean + self.logit_std * z.double())
            # u is the unshifted sigma; the table is indexed by 1 - sigma, so the shift still applies
            idx = ((1 - u) * n).long().clamp(0, n - 1)
        else:
            lo, hi = (int(b * n) for b in self.boundaries)
            idx = torch.randint(lo, hi, (batch_size,), generator=generator, device=generator.device).cpu()
        weight = weights[idx] if self.weighting == "bell" else torch.ones(batch_size)
        return sigmas[idx], timesteps[idx], weight


def _check_boundaries(boundaries, n: int, sampling: str) -> tuple[float, float]:
    lo, hi = (float(b) for b in boundaries)
    if not 0.0 <= lo < hi <= 1.0 or int(lo * n) >= int(hi * n):
        raise UserError(f"--min_timestep_boundary {lo} / --max_timestep_boundary {hi}: need 0 <= min < max <= 1 "
                        f"with at least one of the {n} training timesteps between them")
    if (lo, hi) != (0.0, 1.0) and sampling != "uniform":
        raise UserError("--min/--max_timestep_boundary work with --timestep_sampling uniform only")
    return lo, hi


def bell_weights(timesteps: torch.Tensor, num_train_timesteps: int = 1000) -> torch.Tensor:
    """DiffSynth-Studio's loss weight: exp(-2((t - T/2)/T)^2), minus its minimum, scaled to mean 1, in float32
    arithmetic as the reference computes it (float64 rounded once put 67-80 % of the weights up to 4e-5 apart)."""
    t = timesteps.float()
    y = torch.exp(-2 * ((t - num_train_timesteps / 2) / num_train_timesteps) ** 2)
    y = y - y.min()
    return y * (len(y) / y.sum())
