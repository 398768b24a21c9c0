"""FLUX.2's latent layout: the VAE's 32-channel posterior mode cut into 2x2 patches (128 channels at 1/16 of the
image's size) and normalised by the VAE's BatchNorm statistics, as diffusers' Flux2 pipelines do. Values keep it as
(B, 128, H/16, W/16); the DiT sees it flattened to (B, H/16 * W/16, 128) tokens (`model_fn.py`)."""

from __future__ import annotations

import torch

from ...parts import flux2_vae

LATENT_CHANNELS = flux2_vae.PATCHED_CHANNELS  # 128
VAE_SCALE = flux2_vae.VAE_SCALE * flux2_vae.PATCH  # 16: VAE x8, then 2x2 patches


def vae_encode(pipe, images: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [-1, 1] -> normalised patch latents (B, 128, H/16, W/16), the posterior mode."""
    return flux2_vae.encode(pipe.vae, images.to(pipe.device)).to(pipe.torch_dtype)


def vae_decode(pipe, latents: torch.Tensor) -> torch.Tensor:
    return flux2_vae.decode(pipe.vae, latents.to(pipe.device))


def image_ids(height: int, width: int, t: int = 0) -> torch.Tensor:
    """(H*W, 4) positions (t, h, w, 0) of a latent grid (diffusers' `_prepare_latent_ids` / `_prepare_image_ids`)."""
    return torch.cartesian_prod(torch.tensor([t]), torch.arange(height), torch.arange(width), torch.arange(1))


def text_ids(length: int) -> torch.Tensor:
    """(L, 4) positions (0, 0, 0, l) of the prompt's tokens."""
    return torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(length))


__all__ = ["LATENT_CHANNELS", "VAE_SCALE", "image_ids", "text_ids", "vae_decode", "vae_encode"]
