"""FLUX.1 Fill (`black-forest-labs/FLUX.1-Fill-dev:flux1-fill-dev.safetensors`, the DiT in BFL's layout, or the
repository's `transformer/` in diffusers') and its condition.

The Fill DiT is FLUX.1-dev's with a 384-wide input: per 2x2 patch token, the noisy latents (64), the masked image's
latents (64) and the mask at pixel resolution folded into latent channels (8x8 = 64 per latent pixel, 256 per
token). Its output stays 64 wide (diffusers: `in_channels=384, out_channels=64`).

`FluxFillCondition` (unit, VAE only; the reference's `FluxImageUnit_FillCondition`, diffusers' `FluxFillPipeline`
mask preparation): `flux_fill_image` and `flux_fill_mask` are resized to the output (Lanczos), the mask turned grey
and binarised at 0.5, the image (in [-1, 1]) multiplied by 1 - mask and VAE-encoded, and the mask folded into 64
channels: `fill_condition` (B, 80, H/8, W/8). model_fn concatenates it to the noisy latents
before packing, which gives the 384 inputs in the order the DiT was trained with. A Fill DiT without a fill image
gets an all-masked condition (zeros and ones), as the reference.
"""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image

from ...core.features import IMAGE, Feature
from ...core.options import sample_input
from ...core.units import PipelineUnit
from ...errors import UserError
from ...media.image import as_image_list, images_to_tensor
from .components import FLUX1_FILL_TRANSFORMER_CONFIG  # noqa: F401  (re-exported)

FILL_IN_CHANNELS = 384
FILL_CONDITION_CHANNELS = 80  # 16 masked-image latent channels + the 8x8 mask folded into 64
VAE_SCALE = 8

def is_fill_dit(dit) -> bool:
    return getattr(dit.config, "in_channels", 64) == FILL_IN_CHANNELS


def fold_mask(mask: torch.Tensor, scale: int = VAE_SCALE) -> torch.Tensor:
    """(B, 1, H, W) pixel mask -> (B, scale^2, H/scale, W/scale): each latent pixel's scale x scale mask values as
    channels, row-major within the block (diffusers' FluxFillPipeline.prepare_mask_latents)."""
    b, _, h, w = mask.shape
    m = mask[:, 0].reshape(b, h // scale, scale, w // scale, scale).permute(0, 2, 4, 1, 3)
    return m.reshape(b, scale * scale, h // scale, w // scale)


def binary_mask(mask: Image.Image, height: int, width: int) -> torch.Tensor:
    """(1, 1, H, W): the mask turned grey, resized (Lanczos), 1 where it is at least mid-grey (to fill)."""
    grey = mask.convert("L").resize((width, height), resample=Image.LANCZOS)
    values = torch.from_numpy(np.asarray(grey, dtype=np.float32) / 255.0)
    return (values >= 0.5).float()[None, None]


class FluxFillCondition(PipelineUnit):
    """`flux_fill_image` + `flux_fill_mask` -> `fill_condition` (B, 80, H/8, W/8) for a Fill DiT (VAE only)."""

    feature = "fill"
    before = ("FluxClipEmbedder",)
    inputs = ("flux_fill_image", "flux_fill_mask", "height", "width", "batch_size")
    outputs = ("fill_condition",)
    models = ("vae",)

    def process(self, pipe, flux_fill_image, flux_fill_mask, height, width, batch_size):
        from ...parts.flux_ae import vae_encode

        n = int(batch_size or 1)
        if flux_fill_image is None or flux_fill_mask is None:
            if (flux_fill_image is None) != (flux_fill_mask is None):
                raise UserError("FLUX.1 Fill needs both flux_fill_image and flux_fill_mask (or neither: all to fill)")
            latents = torch.zeros(n, 16, height // VAE_SCALE, width // VAE_SCALE)
            folded = torch.ones(n, VAE_SCALE * VAE_SCALE, height // VAE_SCALE, width // VAE_SCALE)
            return {"fill_condition": torch.cat([latents, folded], 1).to(pipe.device, pipe.torch_dtype)}
        images, masks = as_image_list(flux_fill_image), as_image_list(flux_fill_mask)
        if len(images) != len(masks):
            raise UserError(f"{len(images)} flux_fill_image(s) but {len(masks)} flux_fill_mask(s)")
        mask = torch.cat([binary_mask(m, height, width) for m in masks])
        masked = images_to_tensor(images, height, width) * (1 - mask)
        latents = vae_encode(pipe, masked)
        condition = torch.cat([latents, fold_mask(mask).to(latents.device, latents.dtype)], dim=1)
        if condition.shape[0] == 1 and n > 1:
            condition = condition.expand(n, -1, -1, -1)
        return {"fill_condition": condition.to(pipe.torch_dtype).contiguous()}



class _Fill(Feature):
    def denoise(self, pipe, call):
        """The masked image's latents and the folded mask as channels after the noisy latents'."""
        call.channels.append(call.values["fill_condition"])
        call.channels_for = "flux_fill_image / flux_fill_mask are for a FLUX.1 Fill DiT"


IMAGE_COLUMN, MASK_COLUMN = "flux_fill_image", "flux_fill_mask"
FILL = _Fill("fill", columns=(IMAGE_COLUMN, MASK_COLUMN), model_fn_inputs=("fill_condition",),
             units=(FluxFillCondition(),), inputs={IMAGE_COLUMN: IMAGE, MASK_COLUMN: IMAGE},
             call_inputs={IMAGE_COLUMN: None, MASK_COLUMN: None},
             flags={IMAGE_COLUMN: sample_input("FLUX.1 Fill: the image to fill in.", load="RGB"),
                    MASK_COLUMN: sample_input("FLUX.1 Fill: the region to fill (light).", load="RGB")},
             description="FLUX.1 Fill: a masked image and its mask as condition channels")

__all__ = ["FILL", "FLUX1_FILL_TRANSFORMER_CONFIG", "FluxFillCondition", "binary_mask",
           "fold_mask", "is_fill_dit"]
