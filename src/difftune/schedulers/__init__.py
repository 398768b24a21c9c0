"""Noise schedulers."""

from .flow_match import QWEN_IMAGE_CONFIG, TRAINING_MU, FlowMatchScheduler, bell_weights, calculate_shift

__all__ = ["QWEN_IMAGE_CONFIG", "TRAINING_MU", "FlowMatchScheduler", "bell_weights", "calculate_shift"]
