"""Noise schedulers."""

from .flow_match import FlowMatchScheduler, bell_weights, calculate_shift

__all__ = ["FlowMatchScheduler", "bell_weights", "calculate_shift"]
