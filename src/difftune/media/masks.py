"""Mask images -> tensors, shared by the families' control features (family-free).

* `mask_values`: a mask image as (H, W) in [-1, 1], its colour channels averaged (what the reference's
  `preprocess_image(mask).mean(channels)` gives).
* Inpaint ControlNets (FLUX's alimama Inpainting-Beta, Qwen-Image's Blockwise Inpaint): the control image is
  blacked out where the mask is light (`blank_masked_pixels`) and a channel, 1 where the image is kept and 0 where
  it is to be filled, joins its latents at latent resolution (`keep_channel`).
* Regional prompts (EliGen, FLUX and Qwen-Image): `entity_token_masks` gives each entity's 2x2 patch tokens.
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


def entity_token_masks(masks, height: int, width: int, vae_scale: int, patch: int = 2) -> torch.Tensor:
    """Entity mask images -> (N, (h/patch) * (w/patch)) float token masks in the DiT's row-major token order (1: the
    token is inside the entity). A mask is taken at latent resolution (nearest), a pixel counting where its
    colour channels average above mid-grey; a patch token is inside when any of its latent pixels is."""
    out = []
    h, w = height // vae_scale, width // vae_scale
    for mask in masks:
        inside = mask_values(mask, (w, h), resample=Image.NEAREST) > 0
        out.append(inside.view(h // patch, patch, w // patch, patch).any(dim=3).any(dim=1).flatten())
    return torch.stack(out).float()


__all__ = ["blank_masked_pixels", "entity_token_masks", "keep_channel", "mask_values"]
