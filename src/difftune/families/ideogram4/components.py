"""Ideogram-4 components: the official configs, how their checkpoints are recognised, the key layouts.

The DiT is diffusers' `Ideogram4Transformer2DModel` (a conditional one in `transformer/` and an unconditional one of
the same architecture in `unconditional_transformer/`), the text encoder transformers' `Qwen3VLModel` (Qwen3-VL-8B,
`parts/qwen3_vl.py`) and the VAE diffusers' `AutoencoderKLFlux2` (`parts/flux2_vae.py`).

The files the reference's scripts name (DiffSynth-Studio/ideogram-4-bf16-repackage, and ideogram-ai's own releases)
keep Ideogram's original DiT names: a fused `attention.qkv` and `attention.o` where diffusers has `to_q`, `to_k`,
`to_v` and `to_out.0`; every other name is diffusers'. diffusers has no single-file converter for this DiT, so the
split is done here (q, k, v are the thirds of qkv's rows, in that order).
"""

from __future__ import annotations

import re

import torch

from ...models.detect import ComponentSpec, strip_comfyui_prefix
from ...parts.flux2_vae import FLUX2_VAE_CONFIG, FLUX2_VAE_MARKER_KEYS, flux2_vae_config_from_weights
from ...parts.qwen3_vl import qwen3_vl_spec

# The reference's DiT targets (its scripts' --lora_target_modules), in its own module names.
REFERENCE_LORA_TARGETS = "attention.qkv,attention.o,feed_forward.w1,feed_forward.w2,feed_forward.w3,adaln_modulation"
# The same modules in diffusers' names (the default when a run names none).
LORA_TARGET_MODULES = "to_q,to_k,to_v,to_out.0,feed_forward.w1,feed_forward.w2,feed_forward.w3,adaln_modulation"
# The reference's module names -> ours, so its --lora_target_modules work unchanged.
LORA_TARGET_ALIASES = {"attention.qkv": "attention.to_q,attention.to_k,attention.to_v", "qkv": "to_q,to_k,to_v",
                       "attention.o": "attention.to_out.0", "o": "to_out.0"}

# ideogram-ai's transformer/ (and unconditional_transformer/) config in diffusers' terms.
IDEOGRAM4_TRANSFORMER_CONFIG = {
    "_class_name": "Ideogram4Transformer2DModel",
    "in_channels": 128,
    "num_layers": 34,
    "attention_head_dim": 256,
    "num_attention_heads": 18,
    "intermediate_size": 12288,
    "adaln_dim": 512,
    "llm_features_dim": 53248,
    "rope_theta": 5000000,
    "mrope_section": [24, 20, 20],
    "norm_eps": 1e-05,
}

_QKV = re.compile(r"^(layers\.\d+\.attention\.)qkv\.weight$")
_OUT = re.compile(r"^(layers\.\d+\.attention\.)o\.weight$")


def convert_original_dit(state: dict) -> dict:
    """Ideogram's original DiT names (fused `attention.qkv`, `attention.o`) -> diffusers'. Works on meta tensors."""
    if not any(_QKV.match(k) for k in state):
        raise KeyError("not the original Ideogram-4 layout")
    out = {}
    for key, value in state.items():
        m = _QKV.match(key)
        if m:
            for name, part in zip(("to_q", "to_k", "to_v"), value.chunk(3, dim=0)):
                out[f"{m.group(1)}{name}.weight"] = part
            continue
        m = _OUT.match(key)
        out[f"{m.group(1)}to_out.0.weight" if m else key] = value
    return out


def original_dit_keys(state: dict) -> dict:
    """diffusers' DiT names -> the original ones (q, k, v fused): the inverse of `convert_original_dit`, for
    `--full_format original` and the single-file test models."""
    out, qkv = {}, {}
    for key, value in state.items():
        m = re.match(r"^(layers\.\d+\.attention\.)to_([qkv])\.weight$", key)
        if m:
            qkv.setdefault(f"{m.group(1)}qkv.weight", {})[m.group(2)] = value
            continue
        out[re.sub(r"^(layers\.\d+\.attention\.)to_out\.0\.weight$", r"\1o.weight", key)] = value
    for key, parts in qkv.items():
        out[key] = torch.cat([parts["q"], parts["k"], parts["v"]], dim=0)
    return out


def mrope_section(head_dim: int) -> list[int]:
    """The (t, h, w) split of the head's rotary frequencies: the official 24/20/20 of 256 dims, scaled (the split is
    not in the weights)."""
    total = head_dim // 4
    side = total * 20 // 64
    return [total - 2 * side, side, side]


def dit_config_from_weights(shapes: dict) -> dict | None:
    """An Ideogram-4 DiT of any depth and width (diffusers' names)."""
    needed = ("input_proj.weight", "llm_cond_proj.weight", "adaln_proj.weight", "layers.0.attention.norm_q.weight",
              "layers.0.feed_forward.w1.weight")
    if not all(k in shapes for k in needed):
        return None
    hidden, in_channels = shapes["input_proj.weight"]
    head = shapes["layers.0.attention.norm_q.weight"][0]
    if hidden % head:
        return None
    return {**IDEOGRAM4_TRANSFORMER_CONFIG, "in_channels": in_channels, "attention_head_dim": head,
            "num_attention_heads": hidden // head,
            "num_layers": len({k.split(".")[1] for k in shapes if k.startswith("layers.")}),
            "intermediate_size": shapes["layers.0.feed_forward.w1.weight"][0],
            "adaln_dim": shapes["adaln_proj.weight"][0], "llm_features_dim": shapes["llm_cond_proj.weight"][1],
            "mrope_section": mrope_section(head)}


DIT = ComponentSpec(
    name="dit", library="diffusers", class_name="Ideogram4Transformer2DModel", extra_slots=("dit_uncond",),
    known_configs={"ideogram-ai/ideogram-4 transformer": IDEOGRAM4_TRANSFORMER_CONFIG},
    marker_keys=("input_proj.weight", "llm_cond_proj.weight", "layers.0.attention.to_q.weight"),
    normalize_key=strip_comfyui_prefix, infer_config=dit_config_from_weights,
    description="Ideogram-4 DiT (the conditional one, then the unconditional one)")

# The original layout (the reference's bf16 repackage, ideogram-ai's files): same class and configs, qkv split.
DIT_ORIGINAL = ComponentSpec(
    name="dit", library="diffusers", class_name="Ideogram4Transformer2DModel", extra_slots=("dit_uncond",),
    known_configs=DIT.known_configs,
    marker_keys=("input_proj.weight", "llm_cond_proj.weight", "layers.0.attention.qkv.weight"),
    normalize_key=strip_comfyui_prefix, convert_state_dict=convert_original_dit, infer_config=dit_config_from_weights,
    description="Ideogram-4 DiT, original names (fused attention.qkv)")

TEXT_ENCODER = qwen3_vl_spec("text_encoder", "Qwen3-VL-8B text encoder (13 layers' hidden states)")

VAE = ComponentSpec(
    name="vae", library="diffusers", class_name="AutoencoderKLFlux2",
    known_configs={"FLUX.2 autoencoder (Ideogram-4 vae/)": FLUX2_VAE_CONFIG}, marker_keys=FLUX2_VAE_MARKER_KEYS,
    infer_config=flux2_vae_config_from_weights, description="FLUX.2 autoencoder (32 channels, 2x2 patches)")

COMPONENTS = (DIT, TEXT_ENCODER, VAE, DIT_ORIGINAL)

__all__ = ["COMPONENTS", "DIT", "DIT_ORIGINAL", "IDEOGRAM4_TRANSFORMER_CONFIG", "LORA_TARGET_ALIASES",
           "LORA_TARGET_MODULES", "REFERENCE_LORA_TARGETS", "TEXT_ENCODER", "VAE", "convert_original_dit",
           "dit_config_from_weights", "mrope_section", "original_dit_keys"]
