"""Z-Image's base units (size check, noise, the input image) and the VAE maths every unit shares.

Values keep a leading batch dimension. The VAE is FLUX.1's autoencoder: latents are (z - shift) * scale of the
posterior mode, 16 channels at 1/8 of the image's size.
"""

from __future__ import annotations

import torch

from ...core.common_units import InputImageEmbedder, ShapeChecker
from ...core.latents import seeded_noise
from ...core.units import PipelineUnit

DIVISION_FACTOR = 16  # VAE x8, then 2x2 patches
VAE_SCALE = 8
LATENT_CHANNELS = 16


def omni_dit(context) -> bool:
    """Whether the run's DiT is Omni-Base's (its config's siglip_feat_dim)."""
    return (context.config("dit") or {}).get("siglip_feat_dim") is not None


def vae_encode(pipe, images: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [-1, 1] -> Z-Image latents (z - shift) * scale, the posterior mode (deterministic)."""
    vae = pipe.vae
    z = vae.encode(images.to(device=pipe.device, dtype=vae.dtype)).latent_dist.mode()
    return ((z - vae.config.shift_factor) * vae.config.scaling_factor).to(pipe.torch_dtype)


def vae_decode(pipe, latents: torch.Tensor) -> torch.Tensor:
    vae = pipe.vae
    z = latents.to(device=pipe.device, dtype=vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
    return vae.decode(z).sample


class ZImageShapeChecker(ShapeChecker):
    """Round height and width up to multiples of 16 (VAE x8 and 2x2 patches)."""


class ZImageNoiseInitializer(PipelineUnit):
    """Initial noise (B, 16, H/8, W/8) from `seed`, drawn on `rand_device` (the CPU by default, so a seed gives the
    same noise anywhere)."""

    inputs = ("height", "width", "seed", "batch_size", "rand_device")
    outputs = ("noise",)

    def process(self, pipe, height, width, seed, batch_size, rand_device):
        noise = seeded_noise((LATENT_CHANNELS, height // VAE_SCALE, width // VAE_SCALE), seed, batch_size,
                             device=rand_device or "cpu")
        return {"noise": noise.to(device=pipe.device, dtype=pipe.torch_dtype)}


class ZImageInputImageEmbedder(InputImageEmbedder):
    encode = staticmethod(vae_encode)
