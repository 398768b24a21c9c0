"""What image ControlNets of several families share: the reference's `ControlNetInput` and the control image's encode
(resized to the output, blacked out where an inpaint mask is light, VAE-encoded, a "keep" channel beside its latents).
The ControlNet itself runs in each family's model_fn."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from PIL import Image

from ..media.image import images_to_tensor
from ..media.masks import blank_masked_pixels, keep_channel


@dataclass
class ControlNetInput:
    """The reference's ControlNet input (`controlnet_inputs=[ControlNetInput(image=..., processor_id="canny")]`);
    which fields a pipeline takes is its own to say (one ControlNet over all steps is what the pipelines run)."""

    controlnet_id: int = 0
    scale: float = 1.0
    start: float = 1.0
    end: float = 0.0
    image: Any = None
    inpaint_image: Any = None
    inpaint_mask: Any = None
    processor_id: Any = None


def encode_control_images(pipe, images: list[Image.Image], masks: list, height: int | None, width: int | None,
                          encode: Callable, mask_at_image_size: bool = False) -> list[torch.Tensor]:
    """Each control image's latents (1, C [+1], h, w): the image resized (Lanczos) to height x width when both are
    given (the control image covers the output); with its inpaint mask (None: none), blacked out where the mask is
    light and followed by the keep channel (1 - mask at latent resolution, nearest; the mask read at its own size,
    or first resized to the image's with `mask_at_image_size`). `encode(pipe, images)` is the family's VAE encode."""
    out = []
    for image, mask in zip(images, masks):
        image = image.convert("RGB")
        if height is not None and width is not None and image.size != (width, height):
            image = image.resize((width, height), Image.LANCZOS)
        if mask is not None:
            image = blank_masked_pixels(image, mask)
        latents = encode(pipe, images_to_tensor(image))
        if mask is not None:
            keep = keep_channel(mask, tuple(latents.shape[-2:]), image.size if mask_at_image_size else None)
            latents = torch.cat([latents, keep.to(latents.device, latents.dtype)], dim=1)
        out.append(latents)
    return out


__all__ = ["ControlNetInput", "encode_control_images"]
