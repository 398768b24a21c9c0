"""FLUX.2's latent layout: the VAE's 32-channel posterior mode cut into 2x2 patches (128 channels at 1/16 of the
image's size) and normalised by the VAE's BatchNorm statistics, as diffusers' Flux2 pipelines do. Values keep it as
(B, 128, H/16, W/16); the DiT sees it flattened to (B, H/16 * W/16, 128) tokens (`model_fn.py`)."""

from __future__ import annotations

import torch

LATENT_CHANNELS = 128
VAE_SCALE = 16  # VAE x8, then 2x2 patches


def patchify(z: torch.Tensor) -> torch.Tensor:
    b, c, h, w = z.shape
    return z.view(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)


def unpatchify(z: torch.Tensor) -> torch.Tensor:
    b, c, h, w = z.shape
    return z.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // 4, h * 2, w * 2)


def _bn_stats(vae, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(like.device, like.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + vae.config.batch_norm_eps).to(like.device, like.dtype)
    return mean, std


def vae_encode(pipe, images: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [-1, 1] -> normalised patch latents (B, 128, H/16, W/16), the posterior mode."""
    vae = pipe.vae
    z = patchify(vae.encode(images.to(device=pipe.device, dtype=vae.dtype)).latent_dist.mode())
    mean, std = _bn_stats(vae, z)
    return ((z - mean) / std).to(pipe.torch_dtype)


def vae_decode(pipe, latents: torch.Tensor) -> torch.Tensor:
    vae = pipe.vae
    z = latents.to(device=pipe.device, dtype=vae.dtype)
    mean, std = _bn_stats(vae, z)
    return vae.decode(unpatchify(z * std + mean)).sample


def image_ids(height: int, width: int, t: int = 0) -> torch.Tensor:
    """(H*W, 4) positions (t, h, w, 0) of a latent grid (diffusers' `_prepare_latent_ids` / `_prepare_image_ids`)."""
    return torch.cartesian_prod(torch.tensor([t]), torch.arange(height), torch.arange(width), torch.arange(1))


def text_ids(length: int) -> torch.Tensor:
    """(L, 4) positions (0, 0, 0, l) of the prompt's tokens."""
    return torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(length))


__all__ = ["LATENT_CHANNELS", "VAE_SCALE", "image_ids", "patchify", "text_ids", "unpatchify", "vae_decode",
           "vae_encode"]
