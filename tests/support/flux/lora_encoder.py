"""Tiny LoRA-Encoder: `model.safetensors` as DiffSynth-Studio/LoRA-Encoder-FLUX.1-Dev ships it (the reference's
names, CLIP layers as `encoders.N.attn.to_q`), and tiny FLUX LoRAs in the reference's own names for its data."""

from __future__ import annotations

import os
from pathlib import Path

import torch


def write_tiny_lora_encoder(root: str | os.PathLike, *, dit_width: int = 64, num_double_blocks: int = 1,
                            num_single_blocks: int = 1, embed_dim: int = 32, seed: int = 0,
                            name: str = "model.safetensors") -> Path:
    """A tiny encoder for a DiT of `dit_width` and these depths, tokens `embed_dim` wide (the tiny T5's)."""
    from safetensors.torch import save_file

    from difftune.families.flux.lora_encoder import FluxLoRAEncoder, lora_encoder_native_keys

    torch.manual_seed(seed)
    model = FluxLoRAEncoder(dit_width=dit_width, num_double_blocks=num_double_blocks,
                            num_single_blocks=num_single_blocks, embed_dim=embed_dim, intermediate_size=2 * embed_dim,
                            num_attention_heads=2, num_embeds_per_lora=4, num_special_embeds=1)
    path = Path(root) / name
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in lora_encoder_native_keys(model.state_dict()).items()}, str(path))
    return path


def write_reference_named_lora(path: str | os.PathLike, *, dit_width: int = 64, num_double_blocks: int = 1,
                               num_single_blocks: int = 1, rank: int = 2, seed: int = 0) -> Path:
    """A random LoRA on every layer the encoder reads, in the reference's names (`blocks.0.attn.a_to_qkv.lora_A.
    weight`), what its trainer writes."""
    from safetensors.torch import save_file

    from difftune.families.flux.lora_encoder import lora_layers

    g = torch.Generator().manual_seed(seed)
    sd = {}
    for name, _, dim_in, dim_out in lora_layers(dit_width, num_double_blocks, num_single_blocks):
        sd[f"{name}.lora_A.weight"] = torch.randn(rank, dim_in, generator=g)
        sd[f"{name}.lora_B.weight"] = torch.randn(dim_out, rank, generator=g) * 0.1
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(sd, str(path))
    return path
