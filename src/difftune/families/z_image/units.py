"""Z-Image's base units (size check, noise, the input image).

Values keep a leading batch dimension. The VAE is FLUX.1's autoencoder (`parts/flux_ae.py`): latents are
(z - shift) * scale of the posterior mode, 16 channels at 1/8 of the image's size.
"""

from __future__ import annotations

from ...core.common_units import InputImageEmbedder, NoiseInitializer, ShapeChecker
from ...parts.flux_ae import vae_encode

DIVISION_FACTOR = 16  # VAE x8, then 2x2 patches


def omni_dit(context) -> bool:
    """Whether the run's DiT is Omni-Base's (its config's siglip_feat_dim)."""
    return (context.config("dit") or {}).get("siglip_feat_dim") is not None


class ZImageShapeChecker(ShapeChecker):
    """Round height and width up to multiples of 16 (VAE x8 and 2x2 patches)."""


class ZImageNoiseInitializer(NoiseInitializer):
    """Initial noise (B, 16, H/8, W/8) from `seed`, drawn on `rand_device` (the CPU by default, so a seed gives the
    same noise anywhere)."""


class ZImageInputImageEmbedder(InputImageEmbedder):
    encode = staticmethod(vae_encode)
