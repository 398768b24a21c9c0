"""FLUX.1 components in the diffusers layout: the official configs, recognition, the scheduler config.

The configs are those of black-forest-labs/FLUX.1-dev (transformer/, vae/, text_encoder/ = CLIP ViT-L/14's
text model, text_encoder_2/ = T5 v1.1 XXL's encoder). Weights with a config.json beside them are recognised
from it; bare diffusers-layout files by their tensor shapes against these. BFL single-file layouts
(flux1-dev.safetensors, ae.safetensors) are not mapped yet.
"""

from __future__ import annotations

import math
import re
from functools import partial

from ...models.detect import ComponentSpec, strip_comfyui_prefix
from ...parts.clip import CLIP_L_TEXT_CONFIG, CLIP_TEXT_MARKER_KEYS, clip_text_key
from ...parts.flux_ae import AE_MARKER_KEYS, FLUX1_VAE_CONFIG, convert_ldm_ae
from .bfl import convert_bfl_transformer

# The official FLUX.1-dev scheduler/scheduler_config.json (the values that matter here).
SCHEDULER_CONFIG = {
    "base_image_seq_len": 256, "max_image_seq_len": 4096, "base_shift": 0.5, "max_shift": 1.15,
    "num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": True, "time_shift_type": "exponential",
}
# The reference trains FLUX.1 at a static shift of 3: sigma' = 3 s / (1 + 2 s). The exponential time shift
# e^mu / (e^mu + 1/s - 1) is the same curve at mu = ln 3, so the training table is the reference's.
TRAINING_MU = math.log(3.0)
# ... over its table linspace(1, 0.003/1.002, 1000) (`set_timesteps_flux`): the last sigma is 0.0089 after the shift
TRAINING_SIGMA_MIN = 0.003 / 1.002

# The reference's DiT LoRA targets in diffusers' module names (its names -> diffusers'):
# a_to_qkv -> to_q,to_k,to_v; b_to_qkv -> add_{q,k,v}_proj; a_to_out -> to_out.0; b_to_out -> to_add_out;
# ff_a.0/.2 -> ff.net.0.proj/ff.net.2; ff_b.0/.2 -> ff_context.net.0.proj/.2; norm1_a/b.linear ->
# norm1.linear/norm1_context.linear; single blocks: norm.linear, to_qkv_mlp -> to_q,to_k,to_v + proj_mlp,
# proj_out. By peft's suffix rule `proj_out` also takes the transformer's final projection (one more layer
# than the reference, which names its final layer differently).
LORA_TARGET_MODULES = ("to_q,to_k,to_v,add_q_proj,add_k_proj,add_v_proj,to_out.0,to_add_out,ff.net.0.proj,ff.net.2,"
                       "ff_context.net.0.proj,ff_context.net.2,norm1.linear,norm1_context.linear,norm.linear,"
                       "proj_mlp,proj_out")

# The reference's own DiT module names (its FLUX commands' --lora_target_modules) -> diffusers' modules.
# Its fused qkv layers are three Linear layers here (four in the single blocks, with proj_mlp): a_to_qkv / b_to_qkv
# name the double blocks' (image / text) and to_qkv_mlp the single blocks'. The reference trains one adapter on each
# fused layer; so does difftune when these names are given (FUSED_LORA_TARGETS: one lora_A shared by the block's
# parts, one lora_B over their rows, in this order: the rows of the reference's layer).
_DOUBLE = "transformer_blocks.*.attn."
_SINGLE = "single_transformer_blocks.*."
REFERENCE_LORA_TARGETS = {
    "a_to_qkv": ",".join(_DOUBLE + p for p in ("to_q", "to_k", "to_v")),
    "b_to_qkv": ",".join(_DOUBLE + p for p in ("add_q_proj", "add_k_proj", "add_v_proj")),
    "a_to_out": "to_out.0", "b_to_out": "to_add_out", "ff_a.0": "ff.net.0.proj", "ff_a.2": "ff.net.2",
    "ff_b.0": "ff_context.net.0.proj", "ff_b.2": "ff_context.net.2", "norm1_a.linear": "norm1.linear",
    "norm1_b.linear": "norm1_context.linear",
    "to_qkv_mlp": ",".join(_SINGLE + p for p in ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")),
}
FUSED_LORA_TARGETS = ("a_to_qkv", "b_to_qkv", "to_qkv_mlp")

FLUX1_DEV_TRANSFORMER_CONFIG = {
    "_class_name": "FluxTransformer2DModel",
    "attention_head_dim": 128,
    "axes_dims_rope": [16, 56, 56],
    "guidance_embeds": True,
    "in_channels": 64,
    "joint_attention_dim": 4096,
    "num_attention_heads": 24,
    "num_layers": 19,
    "num_single_layers": 38,
    "patch_size": 1,
    "pooled_projection_dim": 768,
}
# FLUX.1-schnell: the same but without the guidance embedder (so is Step1X-Edit's DiT).
FLUX1_SCHNELL_TRANSFORMER_CONFIG = {**FLUX1_DEV_TRANSFORMER_CONFIG, "guidance_embeds": False}
# FLUX.1-Fill-dev: per 2x2 token the noisy latents (64), the masked image's latents (64) and the mask at pixel
# resolution folded into latent channels (256); its output stays 64 wide.
FLUX1_FILL_TRANSFORMER_CONFIG = {**FLUX1_DEV_TRANSFORMER_CONFIG, "in_channels": 384, "out_channels": 64}
# ostris/Flex.2-preview: 8 double blocks; 33 condition channels per latent pixel beside the 16 (4 x 49 = 196 inputs).
FLEX2_TRANSFORMER_CONFIG = {**FLUX1_DEV_TRANSFORMER_CONFIG, "in_channels": 196, "out_channels": 64, "num_layers": 8}

T5_XXL_ENCODER_CONFIG = {
    "architectures": ["T5EncoderModel"],
    "d_ff": 10240,
    "d_kv": 64,
    "d_model": 4096,
    "decoder_start_token_id": 0,
    "dense_act_fn": "gelu_new",
    "dropout_rate": 0.1,
    "eos_token_id": 1,
    "feed_forward_proj": "gated-gelu",
    "initializer_factor": 1.0,
    "is_encoder_decoder": True,
    "is_gated_act": True,
    "layer_norm_epsilon": 1e-06,
    "model_type": "t5",
    "num_decoder_layers": 24,
    "num_heads": 64,
    "num_layers": 24,
    "output_past": True,
    "pad_token_id": 0,
    "relative_attention_max_distance": 128,
    "relative_attention_num_buckets": 32,
    "tie_word_embeddings": False,
    "vocab_size": 32128,
}


def _count(shapes, head: str) -> int:
    pattern = re.compile(rf"^{re.escape(head)}\.(\d+)\.")
    ids = {int(m.group(1)) for k in shapes if (m := pattern.match(k))}
    return max(ids) + 1 if ids else 0


def flux_axes_dims(head_dim: int) -> list[int] | None:
    """FLUX.1's RoPE split of a head (16, 56, 56 of 128) at another head size: 1/8, 7/16, 7/16 (even parts only)."""
    if head_dim % 32:
        return None
    return [head_dim // 8, head_dim * 7 // 16, head_dim * 7 // 16]


def infer_flux_config(shapes: dict[str, tuple[int, ...]]) -> dict | None:
    """A FluxTransformer2DModel config from its tensors' shapes (diffusers names): every size shows in the weights
    (input and output channels, width, head size, depths, text widths, the guidance embedder) except the RoPE split,
    which follows FLUX.1's proportions (`flux_axes_dims`)."""
    try:
        width, in_channels = shapes["x_embedder.weight"]
        head_dim = shapes["transformer_blocks.0.attn.norm_q.weight"][0]
        config = {
            "_class_name": "FluxTransformer2DModel", "patch_size": 1,
            "in_channels": in_channels, "out_channels": shapes["proj_out.weight"][0],
            "attention_head_dim": head_dim, "num_attention_heads": width // head_dim,
            "num_layers": _count(shapes, "transformer_blocks"),
            "num_single_layers": _count(shapes, "single_transformer_blocks"),
            "joint_attention_dim": shapes["context_embedder.weight"][1],
            "pooled_projection_dim": shapes["time_text_embed.text_embedder.linear_1.weight"][1],
            "guidance_embeds": "time_text_embed.guidance_embedder.linear_1.weight" in shapes,
        }
    except (KeyError, ValueError, IndexError):
        return None
    axes = flux_axes_dims(head_dim)
    if axes is None:
        return None
    config["axes_dims_rope"] = axes
    return config


DIT = ComponentSpec(
    name="dit", library="diffusers", class_name="FluxTransformer2DModel",
    known_configs={"black-forest-labs/FLUX.1-dev transformer": FLUX1_DEV_TRANSFORMER_CONFIG,
                   "black-forest-labs/FLUX.1-schnell transformer": FLUX1_SCHNELL_TRANSFORMER_CONFIG,
                   "black-forest-labs/FLUX.1-Fill-dev transformer": FLUX1_FILL_TRANSFORMER_CONFIG,
                   "ostris/Flex.2-preview transformer": FLEX2_TRANSFORMER_CONFIG},
    marker_keys=("x_embedder.weight", "context_embedder.weight", "time_text_embed.text_embedder.linear_1.weight"),
    normalize_key=strip_comfyui_prefix, infer_config=infer_flux_config,
    description="FLUX.1 MMDiT (12B; Fill: 384 inputs; FLEX.2: 196 inputs, 8 double blocks)")

VAE = ComponentSpec(
    name="vae", library="diffusers", class_name="AutoencoderKL",
    known_configs={"black-forest-labs/FLUX.1-dev VAE": FLUX1_VAE_CONFIG},
    marker_keys=AE_MARKER_KEYS, description="FLUX.1 autoencoder (16 latent channels)")

TEXT_ENCODER = ComponentSpec(
    name="text_encoder", library="transformers", class_name="CLIPTextModel", config_class_name="CLIPTextConfig",
    known_configs={"CLIP ViT-L/14 text model": CLIP_L_TEXT_CONFIG},
    marker_keys=CLIP_TEXT_MARKER_KEYS, normalize_key=clip_text_key,
    description="CLIP-L text encoder (pooled prompt)")

TEXT_ENCODER_2 = ComponentSpec(
    name="text_encoder_2", library="transformers", class_name="T5EncoderModel", config_class_name="T5Config",
    known_configs={"T5 v1.1 XXL encoder": T5_XXL_ENCODER_CONFIG},
    marker_keys=("encoder.final_layer_norm.weight", "encoder.block.0.layer.0.SelfAttention.q.weight"),
    description="T5-XXL text encoder (prompt tokens)")

# BFL's original single files: same classes and configs, recognised by their own names, converted whole.
DIT_BFL = ComponentSpec(
    name="dit", library="diffusers", class_name="FluxTransformer2DModel", known_configs=DIT.known_configs,
    marker_keys=("img_in.weight", "double_blocks.0.img_attn.qkv.weight", "final_layer.linear.weight"),
    normalize_key=strip_comfyui_prefix, convert_state_dict=convert_bfl_transformer, infer_config=infer_flux_config,
    description="FLUX.1 MMDiT, BFL single-file layout (flux1-dev / -krea / -kontext / -fill, Flex.2-preview)")

VAE_BFL = ComponentSpec(
    name="vae", library="diffusers", class_name="AutoencoderKL", known_configs=VAE.known_configs,
    marker_keys=("encoder.down.0.block.0.conv1.weight", "decoder.up.0.block.0.conv1.weight", "encoder.norm_out.weight"),
    convert_state_dict=partial(convert_ldm_ae, config=FLUX1_VAE_CONFIG),
    description="FLUX.1 autoencoder, BFL ae.safetensors layout")
