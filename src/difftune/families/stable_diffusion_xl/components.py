"""Stable Diffusion XL components: the official configs, how their checkpoints are recognised, the LoRA targets.

Classes are diffusers' (`UNet2DConditionModel` with text-time micro-conditioning, `AutoencoderKL`) and transformers'
(`CLIPTextModel`, CLIP-L; `CLIPTextModelWithProjection`, OpenCLIP bigG), so stabilityai/stable-diffusion-xl-base-1.0's
diffusers layout (`unet/`, `vae/`, `text_encoder/`, `text_encoder_2/`, `tokenizer/`, `tokenizer_2/`) loads with its
own key names; bare files of the official sizes are recognised by their tensors.
"""

from __future__ import annotations

from ...models.detect import ComponentSpec
from ...parts.clip import (CLIP_BIGG_TEXT_CONFIG, CLIP_L_TEXT_CONFIG, CLIP_PROJECTION_MARKER_KEYS,
                           CLIP_TEXT_MARKER_KEYS, clip_from_prefix, clip_projection_key, clip_text_key,
                           open_clip_from_prefix)
from ...parts.ldm import (KL_F8_XL_VAE_CONFIG, LDM_UNET_PREFIX, LDM_VAE_PREFIX, UNET_MARKER_KEYS, VAE_MARKER_KEYS,
                          only_in, unet_from_ldm, vae_from_ldm)

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

# A single-file checkpoint (Stability's SGM layout every SDXL fine-tune ships: model.diffusion_model.*,
# first_stage_model.*, conditioner.embedders.0.transformer.* = CLIP-L, conditioner.embedders.1.model.* = OpenCLIP
# bigG): the UNet by diffusers' converter, the rest from the same file as companions, matched against the official
# configs above.
CLIP_PREFIX, OPEN_CLIP_PREFIX = "conditioner.embedders.0.transformer.", "conditioner.embedders.1.model."
UNET_SINGLE_FILE = ComponentSpec(
    name="unet", library="diffusers", class_name="UNet2DConditionModel", known_configs=UNET.known_configs,
    marker_keys=(f"{LDM_UNET_PREFIX}input_blocks.0.0.weight", f"{LDM_UNET_PREFIX}label_emb.0.0.weight"),
    convert_state_dict=only_in(True, unet_from_ldm), config_problem=_xl_only,
    description="SDXL UNet in a single-file checkpoint (original names)")
VAE_SINGLE_FILE = ComponentSpec(
    name="vae", library="diffusers", class_name="AutoencoderKL", known_configs=VAE.known_configs,
    marker_keys=(f"{LDM_VAE_PREFIX}encoder.conv_in.weight",), convert_state_dict=only_in(True, vae_from_ldm),
    companion=True,
    description="SDXL autoencoder in a single-file checkpoint")
TEXT_ENCODER_SINGLE_FILE = ComponentSpec(
    name="text_encoder", library="transformers", class_name="CLIPTextModel", config_class_name="CLIPTextConfig",
    known_configs=TEXT_ENCODER.known_configs, marker_keys=(f"{CLIP_PREFIX}text_model.final_layer_norm.weight",),
    convert_state_dict=only_in(True, clip_from_prefix(CLIP_PREFIX)),
    companion=True,
    description="CLIP-L in a single-file checkpoint")
TEXT_ENCODER_2_SINGLE_FILE = ComponentSpec(
    name="text_encoder_2", library="transformers", class_name="CLIPTextModelWithProjection",
    config_class_name="CLIPTextConfig", known_configs=TEXT_ENCODER_2.known_configs,
    marker_keys=(f"{OPEN_CLIP_PREFIX}token_embedding.weight", f"{OPEN_CLIP_PREFIX}text_projection"),
    convert_state_dict=only_in(True, open_clip_from_prefix(OPEN_CLIP_PREFIX)),
    companion=True,
    description="OpenCLIP bigG in a single-file checkpoint")

# the encoder with the projection first: a CLIP-L file (no text_projection) is not one, a bigG file fits both
COMPONENTS = (UNET, TEXT_ENCODER_2, TEXT_ENCODER, VAE, UNET_SINGLE_FILE, VAE_SINGLE_FILE, TEXT_ENCODER_SINGLE_FILE,
              TEXT_ENCODER_2_SINGLE_FILE)

__all__ = ["COMPONENTS", "LORA_TARGET_MODULES", "SDXL_UNET_CONFIG", "TEXT_ENCODER", "TEXT_ENCODER_2", "UNET", "VAE"]
