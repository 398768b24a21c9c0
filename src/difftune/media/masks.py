"""Mask images -> tensors, shared by the families' control features (family-free).

* `mask_values`: a mask image as (H, W) in [-1, 1], its colour channels averaged (what the reference's
  `preprocess_image(mask).mean(channels)` gives).
* Inpaint ControlNets (FLUX's alimama Inpainting-Beta, Qwen-Image's Blockwise Inpaint): the control image is
  blacked out where the mask is light (`blank_masked_pixels`) and a channel, 1 where the image is kept and 0 where
  it is to be filled, joins its latents at latent resolution (`keep_channel`).
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image


def mask_values(mask: Image.Image, size: tuple[int, int] | None = None, resample=None) -> torch.Tensor:
    """(H, W) float in [-1, 1]: the mask (resized to `size` = (width, height) when given), channels averaged."""
    mask = mask.convert("RGB")
    if size is not None and mask.size != tuple(size):
        mask = mask.resize(tuple(size)) if resample is None else mask.resize(tuple(size), resample=resample)
    arr = np.asarray(mask, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(arr).mean(dim=-1)


def blank_masked_pixels(image: Image.Image, mask: Image.Image) -> Image.Image:
    """The image with the pixels where the mask (resized to the image, PIL's default filter) is light set to black."""
    arr = np.array(image.convert("RGB"))
    arr[(mask_values(mask, image.size) > 0).numpy()] = 0
    return Image.fromarray(arr)


def keep_channel(mask: Image.Image, latent_hw: tuple[int, int], size: tuple[int, int] | None = None) -> torch.Tensor:
    """(1, 1, h, w): 1 - the mask's lightness in [0, 1], nearest-resized to latent resolution (1: keep, 0: fill).
    FLUX's reference reads the mask at its own size; `size` resizes it first (Qwen-Image's Blockwise unit)."""
    light = (mask_values(mask, size) + 1) / 2
    return 1 - torch.nn.functional.interpolate(light[None, None], size=tuple(latent_hw))


__all__ = ["blank_masked_pixels", "keep_channel", "mask_values"]
