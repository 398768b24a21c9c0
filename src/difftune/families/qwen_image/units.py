"""Qwen-Image's units: size check, noise, input image, edit image, prompt (with the chat template).

Values keep a leading batch dimension; prompt embeddings of a batch are padded and masked.
"""

from __future__ import annotations

from PIL import Image

from ...core.batch import LIST
from ...core.latents import seeded_noise
from ...core.common_units import InputImageEmbedder, ShapeChecker
from ...core.units import PipelineUnit
from ...media.image import as_image_list, images_to_tensor

from .encoding import (  # noqa: F401  (re-exported: the family's units read them from here)
    DIVISION_FACTOR, EDIT_IMAGE_AREA, EDIT_PROMPT_TEMPLATE, MAX_SEQUENCE_LENGTH, PROMPT_TEMPLATE,
    TOKENIZER_MAX_LENGTH, VAE_SCALE, _latent_stats, edit_image_size, template_drop_count, vae_decode, vae_encode)
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


class QwenImageEditImageEmbedder(PipelineUnit):
    """Qwen-Image-Edit: resize the edit image to about 1 MP (unless told not to) and encode it."""

    inputs = ("edit_image", "edit_image_auto_resize", "batch_size")
    outputs = ("edit_image", "edit_latents")
    models = ("vae",)
    feature = "edit"
    batching = {"edit_latents": LIST}  # Edit-Plus: a list of latents per sample

    def process(self, pipe, edit_image, edit_image_auto_resize, batch_size):
        if edit_image is None:
            return {}
        from .edit_plus import edit_groups, encode_edit_groups

        groups = edit_groups(edit_image, batch_size)
        if groups is not None:  # Edit-Plus: each image at its own size; the originals stay for the prompt
            return {"edit_latents": encode_edit_groups(pipe, groups, edit_image_auto_resize)}
        images = as_image_list(edit_image)
        if edit_image_auto_resize is not False:
            w, h = edit_image_size(*images[0].size)
            images = [img.convert("RGB").resize((w, h), Image.LANCZOS) for img in images]
        latents = vae_encode(pipe, images_to_tensor(images))
        # one image stays one image: a list would read as Edit-Plus to the prompt
        return {"edit_image": images[0] if isinstance(edit_image, Image.Image) else images, "edit_latents": latents}
