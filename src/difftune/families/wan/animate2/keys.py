"""Wan2.2-Animate-2's released layout (`blocks.N.block.self_attn.q`) both ways, its config, the recognition of its
file and the reference's module names on it (trainable models, LoRA targets)."""

from __future__ import annotations

import re

import torch

from ....models.detect import ComponentSpec
from ..components import _strip_comfy_prefix

ANIMATE2_CONFIG = {"_class_name": "WanAnimate2Transformer3DModel", "patch_size": [1, 2, 2], "text_len": 512,
                   "in_dim": 36, "dim": 5120, "ffn_dim": 13824, "freq_dim": 256, "text_dim": 4096, "out_dim": 16,
                   "num_heads": 40, "num_layers": 40, "cross_attn_norm": True, "eps": 1e-6, "use_img_emb": True,
                   "refer_offset_t": 1, "refer_offset_h": 0, "refer_offset_w": -1, "refer_stride": 1}

# the reference's attention names -> diffusers' (inside self_attn / cross_attn)
_ATTENTION = {"q": "to_q", "k": "to_k", "v": "to_v", "o": "to_out.0", "k_img": "add_k_proj", "v_img": "add_v_proj",
              "norm_k_img": "norm_added_k"}


def animate2_from_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    if not any(".block.self_attn." in k for k in state):
        raise KeyError("not a Wan-Animate-2 file")
    from diffusers.loaders.single_file_utils import convert_wan_animate_2_transformer_to_diffusers

    return convert_wan_animate_2_transformer_to_diffusers(dict(state))


def animate2_module_name(name: str) -> str:
    """A module name in the reference's model (`blocks.0.block.self_attn.q`, `dit.` prefix kept) -> ours."""
    name = re.sub(r"(^|\.)blocks\.(\d+)\.block\.", r"\1blocks.\2.", name)
    return re.sub(r"\.(self_attn|cross_attn)\.(q|k|v|o|k_img|v_img|norm_k_img)(?=\.|$)",
                  lambda m: f".{m[1]}.{_ATTENTION[m[2]]}", name)


def animate2_to_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A WanAnimate2Transformer3DModel state dict in the released names (for tiny files and
    `--full_format original`)."""
    inverse = {v: k for k, v in _ATTENTION.items()}
    out = {}
    for key, value in state.items():
        new = re.sub(r"^blocks\.(\d+)\.", r"blocks.\1.block.", key)
        new = re.sub(r"\.(self_attn|cross_attn)\.(to_q|to_k|to_v|to_out\.0|add_k_proj|add_v_proj|norm_added_k)\.",
                     lambda m: f".{m[1]}.{inverse[m[2]]}.", new)
        out[new] = value
    return out


ANIMATE2_ORIGINAL = ComponentSpec(
    name="dit", library="diffusers", class_name="WanAnimate2Transformer3DModel",
    known_configs={"Wan2.2-Animate-2-14B (and -Distilled)": ANIMATE2_CONFIG},
    marker_keys=("patch_embedding.weight", "head.modulation", "blocks.0.block.self_attn.q.weight"),
    normalize_key=_strip_comfy_prefix, convert_state_dict=animate2_from_original,
    foreign_config_classes=("WanAnimate2Transformer", "WanModel"),
    description="Wan2.2-Animate-2-14B transformer (wan_animate_2/wan_animate_2_bf16*.safetensors)")

# The reference's LoRA target names on this model (`--lora_target_modules self_attn.q,self_attn.k,self_attn.v`).
ANIMATE2_LORA_TARGETS = {**{f"{a}.{k}": f"{a}.{v}" for a in ("self_attn", "cross_attn") for k, v in _ATTENTION.items()},
                         "q": "to_q", "k": "to_k", "v": "to_v", "o": "to_out.0", "ffn.0": "ffn.0", "ffn.2": "ffn.2"}


__all__ = ["ANIMATE2_CONFIG", "ANIMATE2_LORA_TARGETS", "ANIMATE2_ORIGINAL", "animate2_from_original",
           "animate2_module_name", "animate2_to_original"]
