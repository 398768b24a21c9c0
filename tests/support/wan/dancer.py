"""A tiny Wan-AI/Wan-Dancer-14B in the released layout: `global_model.safetensors` and `local_model.safetensors`
(one architecture, two sets of weights; Wan-AI's key names plus the Dancer's modules), the UMT5 / VAE / CLIP .pth
files and the tokenizer. Its heads are Wan's 128 channels wide (one head), so bare files are recognised by the
rule the released sizes follow; two blocks, both with a music injector."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from .common import TEXT_DIM, randomise, wan_common_files

FOLDER = "Wan-AI/Wan-Dancer-14B"
FILES = {"global": "global_model.safetensors", "local": "local_model.safetensors"}


def tiny_dancer_dit(seed: int = 41):
    from .tiny import TinyWanSpec
    from difftune.families.wan.dancer.model import WanDancerTransformer

    spec = TinyWanSpec()
    torch.manual_seed(seed)
    dit = WanDancerTransformer(num_attention_heads=1, attention_head_dim=128, in_channels=36, out_channels=16,
                               text_dim=TEXT_DIM, freq_dim=16, ffn_dim=64, num_layers=2, image_dim=spec.clip_hidden,
                               added_kv_proj_dim=128, music_inject_layers=[0, 1], music_latent_dim=16,
                               music_heads=4, music_ff=32)
    return randomise(dit, seed, scale=0.1)


def write_tiny_dancer(models: str | os.PathLike, seed: int = 41) -> Path:
    """Under `models` (the hub base path): Wan-AI/Wan-Dancer-14B with both DiT files and the Wan2.1 files."""
    from safetensors.torch import save_file

    from difftune.families.wan.dancer.keys import dancer_to_original

    root = Path(models) / FOLDER
    root.mkdir(parents=True, exist_ok=True)
    for n, name in enumerate(FILES.values()):
        state = dancer_to_original(tiny_dancer_dit(seed + n).state_dict())
        save_file({k: v.contiguous() for k, v in state.items()}, str(root / name))
    wan_common_files(root, clip=True)
    return root


__all__ = ["FILES", "FOLDER", "tiny_dancer_dit", "write_tiny_dancer"]
