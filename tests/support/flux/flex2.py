"""Tiny FLEX.2-preview: `Flex.2-preview.safetensors` (BFL's layout, 196 input channels) as ostris/Flex.2-preview
ships it; and the tiny FLUX transformers the other variants' writers share."""

from __future__ import annotations

import os
from pathlib import Path

import torch

TINY_HEAD_DIM = 32  # the smallest head whose FLUX RoPE split (1/8, 7/16, 7/16) is even: 4, 14, 14


def tiny_flux_transformer(in_channels: int = 64, out_channels: int | None = None, num_layers: int = 1,
                          num_single_layers: int = 1, guidance_embeds: bool = True, joint_attention_dim: int = 32,
                          pooled_projection_dim: int = 32, seed: int = 0):
    """A FluxTransformer2DModel of 2 heads of 32 (axes 4, 14, 14: what `flex2.infer_flux_config` infers)."""
    from diffusers import FluxTransformer2DModel

    from difftune.families.flux.flex2 import flux_axes_dims

    torch.manual_seed(seed)
    return FluxTransformer2DModel(
        patch_size=1, in_channels=in_channels, out_channels=out_channels, num_layers=num_layers,
        num_single_layers=num_single_layers, attention_head_dim=TINY_HEAD_DIM, num_attention_heads=2,
        joint_attention_dim=joint_attention_dim, pooled_projection_dim=pooled_projection_dim,
        guidance_embeds=guidance_embeds, axes_dims_rope=tuple(flux_axes_dims(TINY_HEAD_DIM))).eval()


def bfl_state(transformer) -> dict[str, torch.Tensor]:
    from difftune.families.flux.bfl import bfl_transformer_from_diffusers

    return {k: v.contiguous() for k, v in bfl_transformer_from_diffusers(transformer.state_dict()).items()}


def write_tiny_flex2(root: str | os.PathLike, *, seed: int = 0, joint_attention_dim: int = 32,
                     pooled_projection_dim: int = 32) -> Path:
    """`<root>/Flex.2-preview.safetensors`: a tiny FLEX.2 transformer (196 input channels, 64 output, guidance
    embedder, 1 double + 1 single block) in BFL's names. Returns the file."""
    from safetensors.torch import save_file

    from difftune.families.flux.flex2 import FLEX_IN_CHANNELS

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    model = tiny_flux_transformer(FLEX_IN_CHANNELS, 64, seed=seed, joint_attention_dim=joint_attention_dim,
                                  pooled_projection_dim=pooled_projection_dim)
    path = root / "Flex.2-preview.safetensors"
    save_file(bfl_state(model), str(path))
    return path
