"""Edit images (the `edit` feature): reference images the DiT attends to beside the image it denoises, as the
reference's `Flux2Unit_EditImageEmbedder` and diffusers' Flux2 pipelines' `image` give them. Each edit image is
VAE-encoded at its own size (the same normalised patch latents as the target's) and joins the target's tokens with
positions (t, h, w, 0), t = 10, 20, ... per image; its predictions are dropped.

Sizes: by default each image is scaled and centre-cropped to about 1024 x 1024 pixels at its aspect ratio, sides
rounded to multiples of 32 (the reference's `edit_image_auto_resize`, which its training always uses);
`edit_image_auto_resize=False` (`--edit_image_auto_resize false`) encodes it as given (sides floored to multiples
of 16).
"""

from __future__ import annotations

import math

import torch
from PIL import Image

from ...core.batch import LIST
from ...core.features import IMAGES, Feature
from ...core.options import sample_input
from ...core.units import PipelineUnit
from ...errors import UserError
from ...media.image import images_to_tensor, per_sample_images
from .latents import image_ids, vae_encode

EDIT_AREA = 1024 * 1024
TIME_STEP = 10  # the time coordinate of the i-th edit image is 10 + 10 i


def auto_size(width: int, height: int, area: int = EDIT_AREA) -> tuple[int, int]:
    """The reference's edit-image size: `area` pixels at the image's aspect ratio, sides rounded to multiples of 32."""
    ratio = width / height
    w = math.sqrt(area * ratio)
    return max(32, round(w / 32) * 32), max(32, round(w / ratio / 32) * 32)


def resize_edit_image(image: Image.Image, auto_resize) -> Image.Image:
    image = image.convert("RGB")
    if auto_resize is None or auto_resize:
        w, h = auto_size(*image.size)
        scale = max(w / image.width, h / image.height)
        image = image.resize((round(image.width * scale), round(image.height * scale)), Image.BILINEAR)
    else:
        w, h = max(16, image.width // 16 * 16), max(16, image.height // 16 * 16)
    left, top = int(round((image.width - w) / 2)), int(round((image.height - h) / 2))
    return image.crop((left, top, left + w, top + h)) if (w, h) != image.size else image


class Flux2EditImageEmbedder(PipelineUnit):
    """Each edit image, resized as the reference does, VAE-encoded at its own size: per sample, a list of
    (128, h, w) normalised patch latents."""

    feature = "edit"
    inputs = ("edit_image", "edit_image_auto_resize", "batch_size")
    outputs = ("edit_latents",)
    models = ("vae",)
    batching = {"edit_latents": LIST}

    def process(self, pipe, edit_image, edit_image_auto_resize, batch_size):
        per_sample = per_sample_images(edit_image, int(batch_size or 1))
        if per_sample is None:
            return {}
        encoded = {}
        latents = []
        for images in per_sample:
            row = []
            for image in images:
                if id(image) not in encoded:  # one image shared by every prompt is encoded once
                    resized = resize_edit_image(image, edit_image_auto_resize)
                    encoded[id(image)] = vae_encode(pipe, images_to_tensor([resized]))[0]
                row.append(encoded[id(image)])
            latents.append(row)
        return {"edit_latents": latents}


class _Edit(Feature):
    def sample_values(self, flags):
        """Edit images, with the family's --edit_image_auto_resize."""
        edit = flags.get("edit_image")
        return {"edit_image": edit, "edit_image_auto_resize": bool(flags["edit_image_auto_resize"])} if edit else {}

    def denoise(self, pipe, call):
        per_sample = call.values.get("edit_latents")
        shapes = {tuple(tuple(lat.shape) for lat in row) for row in per_sample}
        if len(shapes) > 1:
            raise UserError(f"edit images of different sizes in one batch ({sorted(shapes)}): give every sample of a "
                            f"batch edit images of the same sizes")
        tokens = torch.stack([torch.cat([lat.flatten(1).T for lat in row]) for row in per_sample])
        ids = torch.cat([image_ids(lat.shape[1], lat.shape[2], t=TIME_STEP + TIME_STEP * i)
                         for i, lat in enumerate(per_sample[0])])
        call.extra.append((tokens, ids))


EDIT = _Edit("edit", columns=("edit_image",), model_fn_inputs=("edit_latents",), units=(Flux2EditImageEmbedder(),),
             inputs={"edit_image": IMAGES}, call_inputs={"edit_image": None, "edit_image_auto_resize": None},
             flags={"edit_image": sample_input("An edit (reference) image; repeat it for several.", repeat=True,
                                               load="RGB")},
             description="edit images: VAE latents the DiT attends to beside the target's")

__all__ = ["EDIT", "Flux2EditImageEmbedder", "auto_size", "resize_edit_image"]
