"""Stable Diffusion 1.x components: the official configs, how their checkpoints are recognised, the LoRA targets.

Classes are diffusers' (`UNet2DConditionModel`, `AutoencoderKL`) and transformers' (`CLIPTextModel`), so the
diffusers layout of runwayml / AI-ModelScope `stable-diffusion-v1-5` (`unet/`, `vae/`, `text_encoder/`, `tokenizer/`)
loads with its own key names; bare files of the official sizes are recognised by their tensors.
"""

from __future__ import annotations

from ...models.detect import ComponentSpec
from ...parts.clip import CLIP_L_TEXT_CONFIG, CLIP_TEXT_MARKER_KEYS, clip_from_prefix, clip_text_key
from ...parts.ldm import (KL_F8_VAE_CONFIG, LDM_UNET_PREFIX, LDM_VAE_PREFIX, UNET_MARKER_KEYS, VAE_MARKER_KEYS,
                          only_in, unet_from_ldm, vae_from_ldm)

# stable-diffusion-v1-5/unet/config.json (the rest are diffusers' defaults: four blocks 320 .. 1280, 2 layers each)
SD15_UNET_CONFIG = {
    "_class_name": "UNet2DConditionModel",
    "act_fn": "silu",
    "attention_head_dim": 8,
    "block_out_channels": [320, 640, 1280, 1280],
    "center_input_sample": False,
    "cross_attention_dim": 768,
    "down_block_types": ["CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"],
    "downsample_padding": 1,
    "flip_sin_to_cos": True,
    "freq_shift": 0,
    "in_channels": 4,
    "layers_per_block": 2,
    "mid_block_scale_factor": 1,
    "norm_eps": 1e-05,
    "norm_num_groups": 32,
    "out_channels": 4,
    "sample_size": 64,
    "up_block_types": ["UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"],
}

# kohya sd-scripts' U-Net LoRA modules: every Linear of the transformer blocks and their 1x1 projections in and out
LORA_TARGET_MODULES = "to_q,to_k,to_v,to_out.0,ff.net.0.proj,ff.net.2,proj_in,proj_out"


def _not_xl(config: dict) -> str | None:
    """An SDXL UNet (text-time micro-conditioning) is a UNet2DConditionModel too: its own family trains it."""
    if config.get("addition_embed_type") is not None:
        return (f"a UNet with addition_embed_type '{config['addition_embed_type']}' (SDXL's micro-conditioning), "
                f"which the stable_diffusion family does not condition: the stable_diffusion_xl family trains it")
    return None


UNET = ComponentSpec(
    name="unet", library="diffusers", class_name="UNet2DConditionModel",
    known_configs={"stable-diffusion-v1-5 unet": SD15_UNET_CONFIG},
    marker_keys=UNET_MARKER_KEYS, config_problem=_not_xl,
    description="Stable Diffusion 1.x UNet (860M, diffusers UNet2DConditionModel)")

TEXT_ENCODER = ComponentSpec(
    name="text_encoder", library="transformers", class_name="CLIPTextModel", config_class_name="CLIPTextConfig",
    known_configs={"CLIP ViT-L/14 text model": CLIP_L_TEXT_CONFIG},
    marker_keys=CLIP_TEXT_MARKER_KEYS, normalize_key=clip_text_key,
    description="CLIP-L text encoder (last hidden states)")

VAE = ComponentSpec(
    name="vae", library="diffusers", class_name="AutoencoderKL",
    known_configs={"stable-diffusion-v1-5 vae (KL-f8)": KL_F8_VAE_CONFIG},
    marker_keys=VAE_MARKER_KEYS, description="Stable Diffusion autoencoder (KL-f8, 4 latent channels)")

# A single-file checkpoint (the original LDM layout community models ship: model.diffusion_model.*,
# first_stage_model.*, cond_stage_model.transformer.*): the UNet by diffusers' converter, the VAE and CLIP-L from the
# same file as companions, each matched against the official configs above.
CLIP_PREFIX = "cond_stage_model.transformer."
UNET_SINGLE_FILE = ComponentSpec(
    name="unet", library="diffusers", class_name="UNet2DConditionModel", known_configs=UNET.known_configs,
    marker_keys=(f"{LDM_UNET_PREFIX}input_blocks.0.0.weight", f"{LDM_UNET_PREFIX}out.2.weight"),
    convert_state_dict=only_in(False, unet_from_ldm), config_problem=_not_xl,
    description="SD 1.x UNet in a single-file checkpoint (original names)")
VAE_SINGLE_FILE = ComponentSpec(
    name="vae", library="diffusers", class_name="AutoencoderKL", known_configs=VAE.known_configs,
    marker_keys=(f"{LDM_VAE_PREFIX}encoder.conv_in.weight",), convert_state_dict=only_in(False, vae_from_ldm),
    companion=True,
    description="SD 1.x autoencoder in a single-file checkpoint")
TEXT_ENCODER_SINGLE_FILE = ComponentSpec(
    name="text_encoder", library="transformers", class_name="CLIPTextModel", config_class_name="CLIPTextConfig",
    known_configs=TEXT_ENCODER.known_configs, marker_keys=(f"{CLIP_PREFIX}text_model.final_layer_norm.weight",),
    convert_state_dict=only_in(False, clip_from_prefix(CLIP_PREFIX)),
    companion=True,
    description="CLIP-L in a single-file checkpoint")

COMPONENTS = (UNET, TEXT_ENCODER, VAE, UNET_SINGLE_FILE, VAE_SINGLE_FILE, TEXT_ENCODER_SINGLE_FILE)

__all__ = ["COMPONENTS", "LORA_TARGET_MODULES", "SD15_UNET_CONFIG", "TEXT_ENCODER", "UNET", "VAE"]
