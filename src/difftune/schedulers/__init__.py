"""Noise schedulers: flow matching, and epsilon / v-prediction (DDPM training, DDIM sampling)."""

from .diffusion import DiffusionScheduler, scheduler_for
from .flow_match import FlowMatchScheduler, bell_weights, calculate_shift

__all__ = ["DiffusionScheduler", "FlowMatchScheduler", "bell_weights", "calculate_shift", "scheduler_for"]
