"""Omni-Base image(s)-to-image (the `edit` feature): each edit image resized as the reference does, VAE-encoded at
its own size, and its SigLIP2 features on its patch grid, as diffusers' `ZImageOmniPipeline` computes them; the
prompt cut around the images' slots (prompt.py encodes the pieces); and the `omni` feature, Omni-Base's DiT."""

from __future__ import annotations

from PIL import Image

from ...core.batch import LIST
from ...core.features import IMAGES, Feature
from ...core.options import sample_input
from ...core.units import PipelineUnit
from ...errors import UserError
from ...media.image import images_to_tensor, per_sample_images
from ...parts.flux_ae import vae_encode
from .prompt import ZImageEditPromptEmbedder, edit_fixed_texts, encode_texts
from .units import DIVISION_FACTOR, omni_dit

EDIT_IMAGE_MAX_PIXELS = 1024 * 1024


def edit_image_size(width: int, height: int, max_pixels: int = EDIT_IMAGE_MAX_PIXELS) -> tuple[int, int]:
    """The reference's automatic edit-image size: at most `max_pixels`, sides floored to multiples of 16."""
    if width * height > max_pixels:
        scale = (width * height / max_pixels) ** 0.5
        width, height = int(width / scale), int(height / scale)
    return (max(DIVISION_FACTOR, width // DIVISION_FACTOR * DIVISION_FACTOR),
            max(DIVISION_FACTOR, height // DIVISION_FACTOR * DIVISION_FACTOR))


def resize_edit_image(image: Image.Image) -> Image.Image:
    """Scale to cover the size above and centre-crop the rest (no change for a small image of 16-multiples)."""
    image = image.convert("RGB")
    w, h = edit_image_size(*image.size)
    if (w, h) == image.size:
        return image
    scale = max(w / image.width, h / image.height)
    resized = image.resize((max(w, round(image.width * scale)), max(h, round(image.height * scale))), Image.BILINEAR)
    left, top = (resized.width - w) // 2, (resized.height - h) // 2
    return resized.crop((left, top, left + w, top + h))


class ZImageEditImageEmbedder(PipelineUnit):
    """Each edit image, resized as the reference does, VAE-encoded at its own size."""

    feature = "edit"
    inputs = ("edit_image", "batch_size")
    outputs = ("edit_image", "edit_latents")
    models = ("vae",)
    batching = {"edit_latents": LIST}

    def process(self, pipe, edit_image, batch_size):
        per_sample = per_sample_images(edit_image, int(batch_size or 1))
        if per_sample is None:
            return {}
        resized = [[resize_edit_image(i) for i in images] for images in per_sample]
        latents = [[vae_encode(pipe, images_to_tensor([i]))[0] for i in images] for images in resized]
        return {"edit_image": resized, "edit_latents": latents}


class ZImageSiglipEmbedder(PipelineUnit):
    """Each edit image's SigLIP2 features on its patch grid (h, w, C), as diffusers' `prepare_siglip_embeds`."""

    feature = "edit"
    inputs = ("edit_image", "batch_size")
    outputs = ("siglip_embeds",)
    models = ("image_encoder",)
    batching = {"siglip_embeds": LIST}

    def process(self, pipe, edit_image, batch_size):
        per_sample = per_sample_images(edit_image, int(batch_size or 1))
        if per_sample is None:
            return {}
        encoder = pipe.image_encoder
        processor = siglip_processor_for(encoder)
        out = []
        for images in per_sample:
            feats = []
            for image in images:
                inputs = {k: v.to(pipe.device) for k, v in processor(images=[image], return_tensors="pt").items()}
                inputs["pixel_values"] = inputs["pixel_values"].to(encoder.dtype)
                h, w = (int(s) for s in inputs["spatial_shapes"][0])
                hidden = encoder(**inputs).last_hidden_state
                feats.append(hidden[0, : h * w].reshape(h, w, -1).to(pipe.torch_dtype))
            out.append(feats)
        return {"siglip_embeds": out}


def siglip_processor_for(encoder):
    """The SigLIP2 image processor Omni-Base uses (the reference builds it in code, as diffusers' pipeline is
    given it): mean/std 0.5, bilinear, at most the model's `num_patches` patches of its `patch_size`."""
    from transformers import Siglip2ImageProcessor

    cfg = encoder.config
    return Siglip2ImageProcessor(patch_size=cfg.patch_size, max_num_patches=cfg.num_patches, image_mean=[0.5] * 3,
                                 image_std=[0.5] * 3, resample=2, do_resize=True, do_rescale=True,
                                 do_normalize=True)


class ZImageEditTextEmbedder(PipelineUnit):
    """Omni-Base with edit images: the fixed pieces around the images' slots, per sample (they depend on the
    number of images only, and are the same for the prompt and the negative prompt)."""

    feature = "edit"
    inputs = ("edit_image", "batch_size")
    outputs = ("edit_text_embeds",)
    models = ("text_encoder",)
    batching = {"edit_text_embeds": LIST}

    def process(self, pipe, edit_image, batch_size):
        per_sample = per_sample_images(edit_image, int(batch_size or 1))
        if per_sample is None:
            return {}
        counts = sorted({len(images) for images in per_sample})
        texts = [edit_fixed_texts(n) for n in counts]
        encoded = encode_texts(pipe, [t for group in texts for t in group])
        by_count, at = {}, 0
        for n, group in zip(counts, texts):
            by_count[n] = [e.to(pipe.torch_dtype) for e in encoded[at: at + len(group)]]
            at += len(group)
        return {"edit_text_embeds": [list(by_count[len(images)]) for images in per_sample]}


# -- the features ---------------------------------------------------------------------------------------------------

class _Edit(Feature):
    def sample_values(self, flags):
        edit = flags.get("edit_image")
        return {"edit_image": edit[0] if len(edit) == 1 else edit} if edit else {}

    def check(self, context, features):
        if context.config("dit") is not None and not omni_dit(context):
            raise UserError("edit_image: edit images need Z-Image-Omni-Base's DiT "
                            "(Tongyi-MAI/Z-Image-Omni-Base:transformer/); this DiT has no SigLIP embedder")
        if context.config("image_encoder") is None:
            raise UserError("edit_image: Omni-Base's edit images need its SigLIP2 image encoder "
                            "(Tongyi-MAI/Z-Image-Omni-Base:siglip/model.safetensors) in the model flags")

    def denoise(self, pipe, call):
        """Omni mode: the edit images' clean latents and SigLIP features before the target, the prompt's pieces
        around their slots."""
        v = call.values
        if not call.omni:
            if v.get("edit_latents") is not None:
                raise UserError("edit images need Z-Image-Omni-Base's DiT (transformer/ of Tongyi-MAI/Z-Image-Omni-"
                                "Base); this DiT has no SigLIP embedder")
            return
        call.conditions = (v.get("edit_latents"), v.get("siglip_embeds"), v.get("edit_text_embeds"))


EDIT = _Edit("edit", columns=("edit_image",), model_fn_inputs=("edit_latents", "siglip_embeds", "edit_text_embeds"),
             units=(ZImageEditPromptEmbedder(), ZImageEditTextEmbedder(), ZImageEditImageEmbedder(),
                    ZImageSiglipEmbedder()),
             slots=("image_encoder",), inputs={"edit_image": IMAGES}, call_inputs={"edit_image": None},
             flags={"edit_image": sample_input("Omni-Base: an image to edit; repeat it for several.", repeat=True,
                                               load="RGB")},
             description="Omni-Base image(s)-to-image: edit images as VAE latents and SigLIP2 features, the prompt "
                         "around their slots")
OMNI = Feature("omni", when=omni_dit,
               description="Omni-Base's DiT (its config's siglip_feat_dim): the omni forward")
