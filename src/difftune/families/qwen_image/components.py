"""Qwen-Image components: the official configs, how their checkpoints are recognised, the scheduler config.

The configs are the public `config.json` files of the Qwen/Qwen-Image repository (transformer/, vae/,
text_encoder/ = Qwen2.5-VL-7B-Instruct). Weights without a config.json beside them are recognised when
their tensor names and shapes equal those of one of these. Qwen-Image-Edit(-2509/-2511) and -2512 share
the transformer's shapes: bare files load with the Qwen-Image config (so `zero_cond_t`, an Edit-2511
setting that changes no weight, comes from the pipeline, not from here).
"""

from __future__ import annotations

from ...models.detect import ComponentSpec, strip_comfyui_prefix
from ...parts.qwen_image_vae import QWEN_IMAGE_VAE_CONFIG, qwen_image_vae_spec
from ...parts.qwen_vl import QWEN25_VL_7B_CONFIG, qwen25_vl_key

# The official Qwen/Qwen-Image scheduler/scheduler_config.json (the values that matter here).
SCHEDULER_CONFIG = {
    "base_image_seq_len": 256, "max_image_seq_len": 8192, "base_shift": 0.5, "max_shift": 0.9,
    "num_train_timesteps": 1000, "shift": 1.0, "shift_terminal": 0.02, "time_shift_type": "exponential",
    "use_dynamic_shifting": True,
}
TRAINING_MU = 0.8  # the reference's fixed training shift for Qwen-Image (its training table)
# The reference's LoRA targets for the DiT (its example commands): every attention projection, the output
# projections of both MLPs and the modulation layers.
LORA_TARGET_MODULES = ("to_q,to_k,to_v,add_q_proj,add_k_proj,add_v_proj,to_out.0,to_add_out,img_mlp.net.2,img_mod.1,"
                       "txt_mlp.net.2,txt_mod.1")

QWEN_IMAGE_TRANSFORMER_CONFIG = {
    "_class_name": "QwenImageTransformer2DModel",
    "attention_head_dim": 128,
    "axes_dims_rope": [16, 56, 56],
    "guidance_embeds": False,
    "in_channels": 64,
    "joint_attention_dim": 3584,
    "num_attention_heads": 24,
    "num_layers": 60,
    "out_channels": 16,
    "patch_size": 2,
    "pooled_projection_dim": 768,  # in the official file; the diffusers class takes no such argument
}

# Qwen/Qwen-Image-Layered (and DiffSynth-Studio's -Layered-Control): the Qwen-Image transformer plus an embedding of
# the "is RGB" flag (a weight) and the layer-3D RoPE (no weight); its VAE reads and writes RGBA.
QWEN_IMAGE_LAYERED_TRANSFORMER_CONFIG = {**QWEN_IMAGE_TRANSFORMER_CONFIG, "use_additional_t_cond": True,
                                         "use_layer3d_rope": True}
QWEN_IMAGE_LAYERED_VAE_CONFIG = {**QWEN_IMAGE_VAE_CONFIG, "input_channels": 4}

DIT = ComponentSpec(
    name="dit", library="diffusers", class_name="QwenImageTransformer2DModel",
    known_configs={"Qwen/Qwen-Image transformer": QWEN_IMAGE_TRANSFORMER_CONFIG,
                   "Qwen/Qwen-Image-Layered transformer": QWEN_IMAGE_LAYERED_TRANSFORMER_CONFIG},
    marker_keys=("img_in.weight", "txt_in.weight", "txt_norm.weight"), normalize_key=strip_comfyui_prefix,
    description="Qwen-Image MMDiT (20B)")

TEXT_ENCODER = ComponentSpec(
    name="text_encoder", library="transformers", class_name="Qwen2_5_VLForConditionalGeneration",
    config_class_name="Qwen2_5_VLConfig",
    known_configs={"Qwen2.5-VL-7B-Instruct": QWEN25_VL_7B_CONFIG},
    marker_keys=("model.language_model.embed_tokens.weight", "model.visual.patch_embed.proj.weight"),
    normalize_key=qwen25_vl_key, description="Qwen2.5-VL-7B text encoder")

VAE = qwen_image_vae_spec({"Qwen/Qwen-Image-Layered VAE (RGBA)": QWEN_IMAGE_LAYERED_VAE_CONFIG})
