"""FLUX.2's base units: size check, noise, the input image (values keep a leading batch dimension)."""

from __future__ import annotations

from ...core.common_units import EmbeddedGuidance, InputImageEmbedder, NoiseInitializer, ShapeChecker
from .latents import VAE_SCALE, vae_encode

DIVISION_FACTOR = VAE_SCALE


class Flux2ShapeChecker(ShapeChecker):
    """Round height and width up to multiples of 16 (VAE x8 and 2x2 patches)."""


class Flux2NoiseInitializer(NoiseInitializer):
    """Initial noise (B, 128, H/16, W/16) from `seed`, drawn on `rand_device` (the CPU by default), in the patch
    layout diffusers and the reference draw it in."""


class Flux2InputImageEmbedder(InputImageEmbedder):
    encode = staticmethod(vae_encode)


class Flux2EmbeddedGuidance(EmbeddedGuidance):
    """FLUX.2-dev's distilled guidance, one value per sample (klein's DiT has no guidance embedder and ignores it).
    Training feeds the reference's 1.0; sampling the family's default (4.0) or the caller's."""



__all__ = ["DIVISION_FACTOR", "Flux2EmbeddedGuidance", "Flux2InputImageEmbedder", "Flux2NoiseInitializer",
           "Flux2ShapeChecker"]
