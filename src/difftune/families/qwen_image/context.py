"""Qwen-Image In-Context control (DiffSynth-Studio's Qwen-Image-In-Context-Control-Union LoRA): a control image
(canny, depth, pose, ...) is VAE-encoded at the output size and its tokens follow the noisy image's tokens in the
DiT's image sequence, with their own RoPE frame index; the prediction is read from the noisy tokens only."""

from __future__ import annotations

import torch

from ...core.latents import pack_latents
from ...core.units import PipelineUnit
from ...media.image import as_image_list, images_to_tensor
from .encoding import vae_encode


class QwenImageContextImageEmbedder(PipelineUnit):
    """`context_image` -> `context_latents` (B, 16, h, w), resized to the output's height and width."""

    inputs = ("context_image", "height", "width")
    outputs = ("context_latents",)
    models = ("vae",)
    feature = "context"

    def process(self, pipe, context_image, height, width):
        if context_image is None:
            return {}
        return {"context_latents": self.encode(pipe, as_image_list(context_image), height, width)}

    @staticmethod
    def encode(pipe, images, height, width) -> torch.Tensor:
        return vae_encode(pipe, images_to_tensor(images, height, width))


def append_context(tokens: torch.Tensor, shapes: list, context_latents: torch.Tensor | None):
    """The image sequence with the context image's tokens after the noisy ones, and its RoPE shapes."""
    if context_latents is None:
        return tokens, shapes
    context_latents = context_latents.to(tokens.dtype)
    h, w = context_latents.shape[-2:]
    return torch.cat([tokens, pack_latents(context_latents)], dim=1), [*shapes, (1, h // 2, w // 2)]
