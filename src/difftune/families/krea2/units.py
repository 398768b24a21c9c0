"""Krea-2's base units (size check, noise, the input image). Latents are the Qwen-Image VAE's normalised ones,
(B, 16, H/8, W/8); the DiT reads them cut into 2x2 patches (model_fn.py)."""

from __future__ import annotations

from ...core.common_units import InputImageEmbedder, NoiseInitializer, ShapeChecker
from ...parts.qwen_image_vae import vae_encode

DIVISION_FACTOR = 16  # VAE x8, then 2x2 patches
VAE_SCALE = 8
LATENT_CHANNELS = 16


class Krea2ShapeChecker(ShapeChecker):
    """Round height and width up to multiples of 16."""


class Krea2NoiseInitializer(NoiseInitializer):
    """Initial noise (B, 16, H/8, W/8) from `seed`, drawn on `rand_device` (the CPU by default)."""


class Krea2InputImageEmbedder(InputImageEmbedder):
    encode = staticmethod(vae_encode)
