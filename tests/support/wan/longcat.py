"""A tiny LongCat-Video in the layout the reference's LongCat-Video scripts name: `meituan-longcat/LongCat-Video/
dit/diffusion_pytorch_model.safetensors` (+ config.json, class LongCatVideoTransformer3DModel) and Wan2.1's UMT5 /
VAE .pth files in `Wan-AI/Wan2.1-T2V-14B/`."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .common import TEXT_DIM, randomise, wan_common_files

DIT_FOLDER = "meituan-longcat/LongCat-Video/dit"
WAN_FOLDER = "Wan-AI/Wan2.1-T2V-14B"


def tiny_longcat_dit(seed: int = 21, depth: int = 2):
    from difftune.families.wan.longcat.model import LongCatVideoTransformer3DModel

    torch.manual_seed(seed)
    dit = LongCatVideoTransformer3DModel(in_channels=16, out_channels=16, hidden_size=32, depth=depth, num_heads=2,
                                         caption_channels=TEXT_DIM, mlp_ratio=4, adaln_tembed_dim=16,
                                         frequency_embedding_size=16)
    return randomise(dit, seed)


def write_tiny_longcat(models: str | os.PathLike, seed: int = 21) -> Path:
    """Under `models` (the hub base path): the LongCat-Video DiT and the Wan2.1 files beside it."""
    models = Path(models)
    tiny_longcat_dit(seed).save_pretrained(str(models / DIT_FOLDER))
    wan_common_files(models / WAN_FOLDER)
    return models


__all__ = ["DIT_FOLDER", "WAN_FOLDER", "tiny_longcat_dit", "write_tiny_longcat"]
