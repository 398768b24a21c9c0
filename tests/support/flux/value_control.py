"""Tiny AttriCtrl value controller: `models/brightness.safetensors` as DiffSynth-Studio/AttriCtrl-FLUX.1-Dev ships
it (the release's own names)."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def write_tiny_value_controller(root: str | os.PathLike, *, dim_out: int = 32, dim_in: int = 16,
                                prefer_len: int = 4, seed: int = 0, name: str = "models/brightness.safetensors"
                                ) -> Path:
    """A tiny value controller whose tokens are `dim_out` wide (the tiny T5's width). Returns the file."""
    from safetensors.torch import save_file

    from difftune.families.flux.value_control import FluxValueEncoder

    torch.manual_seed(seed)
    model = FluxValueEncoder(dim_in=dim_in, dim_out=dim_out, prefer_len=prefer_len)
    path = Path(root) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path))
    return path
