"""FLUX.1 Kontext (`black-forest-labs/FLUX.1-Kontext-dev`): reference images whose tokens follow the noisy image's.

`FluxKontextEmbedder` VAE-encodes each reference image and packs it; the denoiser call appends those tokens after the
noisy image's, with ids (1, row, column), and cuts them from the output (a loss sees the image's only)."""

from __future__ import annotations

import torch
from PIL import Image

from ...core.features import IMAGES, Feature
from ...core.options import sample_input
from ...core.latents import pack_latents
from ...core.units import PipelineUnit
from ...errors import UserError
from ...media.image import images_to_tensor
from .model_fn import one_set
from ...parts.flux_ae import vae_encode
from .units import DIVISION_FACTOR

COLUMN = "kontext_images"


def _kontext_per_sample(kontext_images, batch_size: int) -> tuple[list[list[Image.Image]], bool]:
    """The reference images of each sample, and whether all samples share one set. An image or a list of
    images is one set for every prompt; a list of lists (training batches) gives each sample its own set."""
    if isinstance(kontext_images, Image.Image):
        return [[kontext_images]], True
    items = list(kontext_images)
    if items and all(isinstance(i, Image.Image) for i in items):
        return [items], True
    if all(isinstance(i, (list, tuple)) and i and all(isinstance(x, Image.Image) for x in i) for i in items) \
            and len(items) == batch_size:
        return [list(i) for i in items], False
    raise UserError("kontext_images must be an image, a list of images, or one list of images per prompt "
                    f"(got {type(kontext_images).__name__} for {batch_size} prompt(s))")


def kontext_ids(h: int, w: int) -> torch.Tensor:
    """(h*w, 3) position ids of a reference image's packed tokens: (1, row, column), as FluxKontextPipeline (the
    first coordinate 1 tells them from the image being generated; rows and columns start at 0, not offset)."""
    rows = torch.arange(h).view(h, 1).expand(h, w)
    cols = torch.arange(w).view(1, w).expand(h, w)
    return torch.stack([torch.ones_like(rows), rows, cols], dim=-1).reshape(h * w, 3).float()


class FluxKontextEmbedder(PipelineUnit):
    """FLUX.1 Kontext: each reference image, its sides floored to multiples of 16 (as diffusers does), is
    VAE-encoded (FLUX shift/scale), packed 2x2 and appended to the noisy tokens with ids (1, row, column).
    Several images follow one another, each with its own ids from (1, 0, 0), as the reference does.
    Writes `kontext_latents` (B, tokens, 64) and `kontext_ids` (B, tokens, 3)."""

    inputs = (COLUMN, "batch_size")
    before = ("FluxClipEmbedder",)
    outputs = ("kontext_latents", "kontext_ids")
    models = ("vae",)
    feature = "kontext"
    skip_without = ("kontext_images",)

    def process(self, pipe, kontext_images, batch_size):
        b = int(batch_size or 1)
        per_sample, shared = _kontext_per_sample(kontext_images, b)
        counts = {len(s) for s in per_sample}
        if len(counts) > 1:
            raise UserError(f"kontext_images: samples of one batch have {sorted(counts)} reference images; "
                            "they must have as many (--batch_size 1 avoids it)")
        tokens, ids = [], []
        for j in range(counts.pop()):
            images = [s[j] for s in per_sample]
            w, h = (side // DIVISION_FACTOR * DIVISION_FACTOR for side in images[0].size)
            if h == 0 or w == 0:
                raise UserError(f"kontext_images: an image of {images[0].size[0]}x{images[0].size[1]} pixels is "
                                f"too small (at least {DIVISION_FACTOR}x{DIVISION_FACTOR})")
            if any(i.size != images[0].size for i in images):
                raise UserError(f"kontext_images: reference image {j + 1} differs in size between the samples of "
                                "one batch (--batch_size 1 avoids it)")
            latents = vae_encode(pipe, images_to_tensor(images, h, w))
            tokens.append(pack_latents(latents))
            ids.append(kontext_ids(h // DIVISION_FACTOR, w // DIVISION_FACTOR))
        latents, ids = torch.cat(tokens, dim=1), torch.cat(ids, dim=0)
        if shared:
            latents = latents.expand(b, -1, -1)
        return {"kontext_latents": latents.contiguous(),
                "kontext_ids": ids.to(pipe.device).unsqueeze(0).expand(b, -1, -1).contiguous()}



class _Kontext(Feature):
    def denoise(self, pipe, call):
        """The reference tokens after the noisy image's."""
        v = call.values
        call.tokens_after = v["kontext_latents"]
        call.ids_after = one_set(v["kontext_ids"].to(device=call.device, dtype=call.dtype), COLUMN)


KONTEXT = _Kontext("kontext", columns=(COLUMN,), model_fn_inputs=("kontext_latents", "kontext_ids"),
                   units=(FluxKontextEmbedder(),), inputs={COLUMN: IMAGES}, call_inputs={COLUMN: None},
                   flags={COLUMN: sample_input("FLUX.1 Kontext: a reference image (repeat for several).", repeat=True,
                                                load="RGB")},
                   description="FLUX.1 Kontext: reference images' tokens beside the image's")

__all__ = ["FluxKontextEmbedder", "KONTEXT", "kontext_ids"]
