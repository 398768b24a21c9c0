"""Qwen-Image's base units: size check, noise, input image, prompt (with the chat template); the features' units
live in their modules (edit_plus, context, controlnet, eligen).

Values keep a leading batch dimension; prompt embeddings of a batch are padded and masked.
"""

from __future__ import annotations

from ...core.latents import seeded_noise
from ...core.common_units import InputImageEmbedder, ShapeChecker
from ...core.units import PipelineUnit

from .encoding import (  # noqa: F401  (re-exported: the family's units read them from here)
    DIVISION_FACTOR, EDIT_IMAGE_AREA, EDIT_PROMPT_TEMPLATE, MAX_SEQUENCE_LENGTH, PROMPT_TEMPLATE,
    TOKENIZER_MAX_LENGTH, VAE_SCALE, edit_image_size, template_drop_count, vae_decode, vae_encode)
from .prompt import QwenImagePromptEmbedder  # noqa: F401


# -- units --------------------------------------------------------------------------------------------


class QwenImageShapeChecker(ShapeChecker):
    """Round height and width up to multiples of 16 (VAE x8 and 2x2 patches)."""


class QwenImageNoiseInitializer(PipelineUnit):
    """Initial noise from `seed`, drawn on `rand_device` so a seed gives the same noise on any accelerator."""

    inputs = ("height", "width", "seed", "rand_device", "batch_size")
    outputs = ("noise",)

    def process(self, pipe, height, width, seed, rand_device, batch_size):
        rand_device = rand_device or "cpu"
        if isinstance(rand_device, (list, tuple)):
            rand_device = rand_device[0]
        noise = seeded_noise((16, height // VAE_SCALE, width // VAE_SCALE), seed, batch_size, rand_device)
        return {"noise": noise.to(device=pipe.device, dtype=pipe.torch_dtype)}


class QwenImageInputImageEmbedder(InputImageEmbedder):
    encode = staticmethod(vae_encode)
