"""Anima's base units (size check, noise, the input image). Latents are the Qwen-Image VAE's normalised ones,
(B, 16, H/8, W/8), the posterior's mean as the reference's VAE gives it; the DiT reads them as one frame in 2x2
patches."""

from __future__ import annotations

from ...core.common_units import InputImageEmbedder, NoiseInitializer, ShapeChecker
from ...parts.qwen_image_vae import vae_encode

DIVISION_FACTOR = 16  # VAE x8, then 2x2 patches
VAE_SCALE = 8
LATENT_CHANNELS = 16


class AnimaShapeChecker(ShapeChecker):
    """Round height and width up to multiples of 16."""


class AnimaNoiseInitializer(NoiseInitializer):
    """Initial noise (B, 16, H/8, W/8) from `seed`, drawn on `rand_device` (the CPU by default)."""


class AnimaInputImageEmbedder(InputImageEmbedder):
    encode = staticmethod(vae_encode)
