"""A tiny DiffSynth-Studio/Wan2.1-1.3b-speedcontrol-v1 (`model.safetensors`, the motion controller in its own key
names) at the tiny Wan DiT's width."""

from __future__ import annotations

from pathlib import Path

import torch

from difftune.families.wan.speed_control import WanMotionController
from .common import TINY, TINY_INNER, save_tensors


def tiny_motion_controller(seed: int = TINY.seed + 40) -> WanMotionController:
    torch.manual_seed(seed)
    return WanMotionController(freq_dim=16, dim=TINY_INNER).eval()


def write_tiny_speed_control(path) -> Path:
    """<path>/model.safetensors; recognised from its shapes (every size shows in them)."""
    return save_tensors(tiny_motion_controller().state_dict(), Path(path) / "model.safetensors")


__all__ = ["tiny_motion_controller", "write_tiny_speed_control"]
