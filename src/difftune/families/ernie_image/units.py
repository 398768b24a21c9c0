"""ERNIE-Image's base units (size check, noise, the input image).

Values keep a leading batch dimension. Latents are the FLUX.2 autoencoder's, patched 2x2 and normalised by its
BatchNorm's statistics (`parts/flux2_vae.py`): 128 channels at 1/16 of the image's size, which the DiT reads as is
(its patch size is 1).
"""

from __future__ import annotations

from ...core.common_units import InputImageEmbedder, ShapeChecker
from ...core.latents import seeded_noise
from ...core.units import PipelineUnit
from ...parts import flux2_vae
from .components import BN_EPS

DIVISION_FACTOR = 16  # VAE x8, then 2x2 patches


def vae_encode(pipe, images):
    return flux2_vae.encode(pipe.vae, images.to(pipe.device), eps=BN_EPS).to(pipe.torch_dtype)


class ErnieImageShapeChecker(ShapeChecker):
    """Round height and width up to multiples of 16 (VAE x8 and 2x2 patches)."""


class ErnieImageNoiseInitializer(PipelineUnit):
    """Initial noise (B, 128, H/16, W/16) from `seed`, drawn on `rand_device` (the CPU by default, so a seed gives
    the same noise anywhere)."""

    inputs = ("height", "width", "seed", "batch_size", "rand_device")
    outputs = ("noise",)

    def process(self, pipe, height, width, seed, batch_size, rand_device):
        shape = (flux2_vae.PATCHED_CHANNELS, height // DIVISION_FACTOR, width // DIVISION_FACTOR)
        noise = seeded_noise(shape, seed, batch_size, device=rand_device or "cpu")
        return {"noise": noise.to(device=pipe.device, dtype=pipe.torch_dtype)}


class ErnieImageInputImageEmbedder(InputImageEmbedder):
    encode = staticmethod(vae_encode)
