"""ERNIE-Image's base units (size check, noise, the input image).

Values keep a leading batch dimension. Latents are the FLUX.2 autoencoder's, patched 2x2 and normalised by its
BatchNorm's statistics (`parts/flux2_vae.py`): 128 channels at 1/16 of the image's size, which the DiT reads as is
(its patch size is 1).
"""

from __future__ import annotations

from ...core.common_units import InputImageEmbedder, NoiseInitializer, ShapeChecker
from ...parts import flux2_vae
from .components import BN_EPS

DIVISION_FACTOR = 16  # VAE x8, then 2x2 patches


def vae_encode(pipe, images):
    return flux2_vae.encode(pipe.vae, images.to(pipe.device), eps=BN_EPS).to(pipe.torch_dtype)


class ErnieImageShapeChecker(ShapeChecker):
    """Round height and width up to multiples of 16 (VAE x8 and 2x2 patches)."""


class ErnieImageNoiseInitializer(NoiseInitializer):
    """Initial noise (B, 128, H/16, W/16) from `seed`, drawn on `rand_device` (the CPU by default, so a seed gives
    the same noise anywhere)."""


class ErnieImageInputImageEmbedder(InputImageEmbedder):
    encode = staticmethod(vae_encode)
