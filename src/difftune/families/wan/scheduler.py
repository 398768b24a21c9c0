"""Wan's scheduler: training as the reference (flow matching at a static shift of 5), sampling with the
repository's own scheduler when there is one.

diffusers' Wan repositories sample with UniPC (`UniPCMultistepScheduler`, flow sigmas, the repository's
`flow_shift`); the reference samples with flow-match Euler at shift 5. To equal diffusers' WanPipeline for the
same seed, steps and guidance, sampling steps diffusers' own scheduler object built from the repository's
scheduler_config.json; without one (weights named file by file) it is the reference's Euler at shift 5.
In training mode (the loss, direct distillation, validation renders during training) it is always the
reference's table.
"""

from __future__ import annotations

import torch

from ...schedulers import FlowMatchScheduler
from .components import TRAINING_SHIFT


class WanScheduler(FlowMatchScheduler):
    def __init__(self, sampler=None):
        super().__init__(shift=TRAINING_SHIFT)
        self.sampler = sampler  # a diffusers scheduler, or None: flow-match Euler at shift 5

    def uses_sampler(self) -> bool:
        return self.sampler is not None and not self.training

    def set_timesteps(self, num_inference_steps: int, **kwargs) -> torch.Tensor:
        if not self.uses_sampler():
            return super().set_timesteps(num_inference_steps, **kwargs)
        if kwargs.get("denoising_strength", 1.0) != 1.0:
            from ...errors import UserError

            raise UserError("denoising_strength < 1 is not supported with the repository's scheduler")
        self.sampler.set_timesteps(int(num_inference_steps))
        self.sampler.set_begin_index(0)
        self.timesteps = self.sampler.timesteps
        self.sigmas = self.sampler.sigmas
        return self.timesteps

    def step(self, model_output: torch.Tensor, step_index: int, sample: torch.Tensor) -> torch.Tensor:
        if not self.uses_sampler():
            return super().step(model_output, step_index, sample)
        return self.sampler.step(model_output, self.timesteps[step_index], sample, return_dict=False)[0]
