"""Stable Diffusion XL components: the official configs, how their checkpoints are recognised, the LoRA targets.

Classes are diffusers' (`UNet2DConditionModel` with text-time micro-conditioning, `AutoencoderKL`) and transformers'
(`CLIPTextModel`, CLIP-L; `CLIPTextModelWithProjection`, OpenCLIP bigG), so stabilityai/stable-diffusion-xl-base-1.0's
diffusers layout (`unet/`, `vae/`, `text_encoder/`, `text_encoder_2/`, `tokenizer/`, `tokenizer_2/`) loads with its
own key names; bare files of the official sizes are recognised by their tensors.
"""

from __future__ import annotations

from ...models.detect import ComponentSpec
from ...parts.clip import (CLIP_BIGG_TEXT_CONFIG, CLIP_L_TEXT_CONFIG, CLIP_PROJECTION_MARKER_KEYS,
                           CLIP_TEXT_MARKER_KEYS, clip_projection_key, clip_text_key)
from ...parts.ldm import KL_F8_XL_VAE_CONFIG, UNET_MARKER_KEYS, VAE_MARKER_KEYS

# stable-diffusion-xl-base-1.0/unet/config.json
SDXL_UNET_CONFIG = {
    "_class_name": "UNet2DConditionModel",
    "act_fn": "silu",
    "addition_embed_type": "text_time",
    "addition_embed_type_num_heads": 64,
    "addition_time_embed_dim": 256,
    "attention_head_dim": [5, 10, 20],
    "block_out_channels": [320, 640, 1280],
    "center_input_sample": False,
    "cross_attention_dim": 2048,
    "down_block_types": ["DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"],
    "downsample_padding": 1,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "out_channels": 4,
    "projection_class_embeddings_input_dim": 2816,
    "sample_size": 128,
    "transformer_layers_per_block": [1, 2, 10],
    "up_block_types": ["CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"],
    "use_linear_projection": True,
}

# kohya sd-scripts' U-Net LoRA modules (the reference's SDXL script names the same 722 modules one by one)
LORA_TARGET_MODULES = "to_q,to_k,to_v,to_out.0,ff.net.0.proj,ff.net.2,proj_in,proj_out"


def _xl_only(config: dict) -> str | None:
    """An SD 1.x UNet has no text-time micro-conditioning: its own family trains it."""
    if config.get("addition_embed_type") != "text_time":
        return ("a UNet without SDXL's text-time micro-conditioning (addition_embed_type "
                f"{config.get('addition_embed_type')!r}): the stable_diffusion family trains it")
    return None


UNET = ComponentSpec(
    name="unet", library="diffusers", class_name="UNet2DConditionModel",
    known_configs={"stable-diffusion-xl-base-1.0 unet": SDXL_UNET_CONFIG},
    marker_keys=(*UNET_MARKER_KEYS, "add_embedding.linear_1.weight"), config_problem=_xl_only,
    description="Stable Diffusion XL UNet (2.6B, diffusers UNet2DConditionModel, text-time conditioning)")

TEXT_ENCODER = ComponentSpec(
    name="text_encoder", library="transformers", class_name="CLIPTextModel", config_class_name="CLIPTextConfig",
    known_configs={"CLIP ViT-L/14 text model": CLIP_L_TEXT_CONFIG},
    marker_keys=CLIP_TEXT_MARKER_KEYS, normalize_key=clip_text_key,
    description="CLIP-L text encoder (second-to-last hidden states)")

TEXT_ENCODER_2 = ComponentSpec(
    name="text_encoder_2", library="transformers", class_name="CLIPTextModelWithProjection",
    config_class_name="CLIPTextConfig", known_configs={"OpenCLIP ViT-bigG/14 text model": CLIP_BIGG_TEXT_CONFIG},
    marker_keys=CLIP_PROJECTION_MARKER_KEYS, normalize_key=clip_projection_key,
    description="OpenCLIP bigG text encoder (second-to-last hidden states, projected EOS embedding)")

VAE = ComponentSpec(
    name="vae", library="diffusers", class_name="AutoencoderKL",
    known_configs={"stable-diffusion-xl-base-1.0 vae (KL-f8)": KL_F8_XL_VAE_CONFIG},
    marker_keys=VAE_MARKER_KEYS, description="SDXL autoencoder (KL-f8, 4 latent channels, scale 0.13025)")

# the encoder with the projection first: a CLIP-L file (no text_projection) is not one, a bigG file fits both
COMPONENTS = (UNET, TEXT_ENCODER_2, TEXT_ENCODER, VAE)

__all__ = ["COMPONENTS", "LORA_TARGET_MODULES", "SDXL_UNET_CONFIG", "TEXT_ENCODER", "TEXT_ENCODER_2", "UNET", "VAE"]
