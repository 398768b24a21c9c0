"""A tiny Wan-AI/Wan2.2-Animate-14B: `diffusion_pytorch_model.safetensors` with the I2V DiT and the animate adapter
in the released names (motion_encoder.enc.net_app.convs.*, face_adapter.fuser_blocks.*.linear1_kv, ...), Wan's
config.json, UMT5 / VAE / CLIP .pth files and the tokenizer. The motion encoder takes 32 px faces (three residual
levels, a few channels each); `face_size=512` gives the released depth (seven levels), which diffusers' own
converter assumes."""

from __future__ import annotations

from pathlib import Path

import torch

from difftune.families.wan.animate import (ANIMATE_ADAPTER_ORIGINAL, ANIMATE_DIT_ORIGINAL, ADAPTER_PREFIXES,
                       animate_adapter_to_original)
from difftune.families.wan.dit_keys import dit_to_original
from .common import TINY, TINY_INNER, base_known_configs, save_tensors, tiny_dit_kwargs, write_base_repo, \
    write_wan_config

TINY_LAYERS = 10  # face adapter after blocks 0 and 5
TINY_FACE_SIZE = 32


def _motion(face_size: int) -> dict:
    return {"motion_encoder_size": face_size, "motion_style_dim": 8, "motion_dim": 4, "motion_encoder_dim": 8,
            "motion_encoder_channel_sizes": {str(2 ** i): 4 for i in range(2, face_size.bit_length())}}
FACE = {"face_encoder_hidden_dim": 8, "face_encoder_num_heads": 2}


def tiny_animate_transformer(seed: int = TINY.seed + 50, face_size: int = TINY_FACE_SIZE):
    """diffusers' WanAnimateTransformer3DModel at the tiny size (the source of the tiny file's tensors)."""
    from diffusers import WanAnimateTransformer3DModel

    torch.manual_seed(seed)
    kwargs = tiny_dit_kwargs(TINY_LAYERS, in_channels=36, image=True)
    kwargs.pop("out_channels")
    return WanAnimateTransformer3DModel(**kwargs, latent_channels=16, out_channels=16, **_motion(face_size), **FACE,
                                        inject_face_latents_blocks=5, motion_encoder_batch_size=8).eval()


def tiny_animate_configs(model) -> tuple[dict, dict]:
    """(the DiT's WanTransformer3DModel config, the WanAnimateAdapter config) of a tiny Animate model."""
    c = dict(model.config)
    dit = {"_class_name": "WanTransformer3DModel", **tiny_dit_kwargs(TINY_LAYERS, in_channels=36, image=True)}
    adapter = {"_class_name": "WanAnimateAdapter", "num_attention_heads": c["num_attention_heads"],
               "attention_head_dim": c["attention_head_dim"], "num_face_blocks": len(model.face_adapter),
               "latent_channels": 16, "patch_size": list(c["patch_size"]), "eps": c["eps"],
               **_motion(c["motion_encoder_size"]), **FACE,
               "inject_face_latents_blocks": 5, "motion_encoder_batch_size": 8}
    return dit, adapter


def animate_file_state(model) -> dict[str, torch.Tensor]:
    state = model.state_dict()
    dit = dit_to_original({k: v for k, v in state.items() if not k.startswith(ADAPTER_PREFIXES)})
    return {**dit, **animate_adapter_to_original({k: v for k, v in state.items() if k.startswith(ADAPTER_PREFIXES)})}


def write_tiny_animate_original(path) -> tuple[Path, list[tuple]]:
    """The tiny repository; returns its folder and the (spec, label, config) the tests add to the official ones."""
    root, twin = write_base_repo(Path(path), "i2v")
    model = tiny_animate_transformer()
    save_tensors(animate_file_state(model), root / "diffusion_pytorch_model.safetensors")
    dit, adapter = tiny_animate_configs(model)
    write_wan_config(root, "WanModel", dit, model_type="animate")
    assert dit["num_attention_heads"] * dit["attention_head_dim"] == TINY_INNER
    return root, base_known_configs(twin) + [(ANIMATE_DIT_ORIGINAL, "tiny", dit),
                                             (ANIMATE_ADAPTER_ORIGINAL, "tiny", adapter)]


__all__ = ["TINY_FACE_SIZE", "animate_file_state", "tiny_animate_configs", "tiny_animate_transformer",
           "write_tiny_animate_original"]
