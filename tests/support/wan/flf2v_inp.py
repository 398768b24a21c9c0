"""Tiny Wan2.1-FLF2V-14B-720P and PAI Fun-InP repositories in the released layout. FLF2V's DiT carries the image
position embedding for two CLIP images under Wan-AI's own name (`img_emb.emb_pos`); Fun-InP's is the I2V DiT with
CLIP (at the tiny size the 1.3B and 14B ones are alike: `write_tiny_wan_original(path, "i2v")`)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file

from .tiny import CLIP_TOKENS, write_tiny_wan_original
from difftune.families.wan.components import DIT_ORIGINAL
from difftune.families.wan.dit_keys import dit_to_original
from .common import TINY, base_known_configs, save_tensors, tiny_dit_kwargs, write_base_repo, write_wan_config


def tiny_flf2v_transformer(seed: int = TINY.seed + 70):
    from diffusers import WanTransformer3DModel

    torch.manual_seed(seed)
    model = WanTransformer3DModel(**tiny_dit_kwargs(2, in_channels=36, image=True),
                                  pos_embed_seq_len=2 * CLIP_TOKENS).eval()
    with torch.no_grad():  # diffusers starts it at zero; a trained one is not
        model.condition_embedder.image_embedder.pos_embed.normal_(0, 0.5)
    return model


def write_tiny_flf2v_original(path) -> tuple[Path, list[tuple]]:
    """Wan-AI/Wan2.1-FLF2V-14B-720P's layout: the DiT (Wan's names), UMT5 / VAE / CLIP .pth, the tokenizer."""
    root, twin = write_base_repo(Path(path), "i2v")
    model = tiny_flf2v_transformer()
    save_tensors(dit_to_original(model.state_dict()), root / "diffusion_pytorch_model.safetensors")
    config = {k: v for k, v in model.config.items() if not k.startswith("_")}
    write_wan_config(root, "WanModel", config, model_type="flf2v")
    return root, base_known_configs(twin) + [(DIT_ORIGINAL, "tiny flf2v", {"_class_name": "WanTransformer3DModel",
                                                                           **config})]


def write_tiny_fun_inp_original(path) -> tuple[Path, list[tuple]]:
    """PAI/Wan2.1-Fun-1.3B-InP's layout (and Fun-V1.1-1.3B-InP's): the I2V DiT with CLIP."""
    root, twin = write_tiny_wan_original(Path(path), "i2v")
    moved = Path(path).parent / f"{Path(path).name}.diffusers"
    twin.rename(moved)
    config = json.loads((moved / "transformer" / "config.json").read_text())
    assert load_file(str(root / "diffusion_pytorch_model.safetensors"))  # written in Wan's names
    return root, base_known_configs(moved) + [(DIT_ORIGINAL, "tiny fun-inp", config)]


__all__ = ["tiny_flf2v_transformer", "write_tiny_flf2v_original", "write_tiny_fun_inp_original"]
