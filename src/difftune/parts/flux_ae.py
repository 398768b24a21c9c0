"""The FLUX.1 autoencoder (BFL's `ae`, a diffusers AutoencoderKL with 16 latent channels at 1/8 of the image's
size): its config, its recognition markers, the single-file (LDM / BFL `ae.safetensors`) layout, and the latent maths
(z - shift) * scale. FLUX.1 and Z-Image ship it."""

from __future__ import annotations

import torch

VAE_SCALE = 8
LATENT_CHANNELS = 16

FLUX1_VAE_CONFIG = {
    "_class_name": "AutoencoderKL",
    "act_fn": "silu",
    "block_out_channels": [128, 256, 512, 512],
    "down_block_types": ["DownEncoderBlock2D"] * 4,
    "up_block_types": ["UpDecoderBlock2D"] * 4,
    "force_upcast": True,
    "in_channels": 3,
    "latent_channels": 16,
    "latents_mean": None,
    "latents_std": None,
    "layers_per_block": 2,
    "mid_block_add_attention": True,
    "norm_num_groups": 32,
    "out_channels": 3,
    "sample_size": 1024,
    "scaling_factor": 0.3611,
    "shift_factor": 0.1159,
    "use_post_quant_conv": False,
    "use_quant_conv": False,
}
AE_MARKER_KEYS = ("encoder.conv_in.weight", "decoder.conv_in.weight", "encoder.conv_out.weight")  # diffusers' names


def convert_ldm_ae(state: dict[str, torch.Tensor], config: dict) -> dict[str, torch.Tensor]:
    """BFL's ae.safetensors (the LDM VAE layout) in diffusers' AutoencoderKL names, by diffusers' converter."""
    from diffusers.loaders.single_file_utils import convert_ldm_vae_checkpoint

    # the converter reads only the number of down/up blocks from the config (4 in every FLUX.1 AE); it pops from
    # what it is given, so it gets a copy
    return convert_ldm_vae_checkpoint(dict(state), config)


def vae_encode(pipe, images: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [-1, 1] -> latents (z - shift) * scale, the posterior mode (deterministic)."""
    vae = pipe.vae
    z = vae.encode(images.to(device=pipe.device, dtype=vae.dtype)).latent_dist.mode()
    return ((z - vae.config.shift_factor) * vae.config.scaling_factor).to(pipe.torch_dtype)


def vae_decode(pipe, latents: torch.Tensor) -> torch.Tensor:
    vae = pipe.vae
    z = latents.to(device=pipe.device, dtype=vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
    return vae.decode(z).sample


__all__ = ["AE_MARKER_KEYS", "FLUX1_VAE_CONFIG", "LATENT_CHANNELS", "VAE_SCALE", "convert_ldm_ae", "vae_decode",
           "vae_encode"]
