"""Z-Image's units: size check, noise, input image, prompt (Qwen3, the chat template), and the Omni-Base edit images
(VAE latents and SigLIP2 features) and the Fun ControlNet's control context, each serving its feature.

Values keep a leading batch dimension. A prompt is the text encoder's second-to-last hidden states of its real
tokens (diffusers' `_encode_prompt`), padded in a batch with its mask; an Omni-Base prompt with edit images is
several pieces (one before each image, one after the last), kept as one padded sequence with the pieces' lengths.
"""

from __future__ import annotations

import torch
from PIL import Image

from ...core.batch import LIST, Pad
from ...core.common_units import InputImageEmbedder, ShapeChecker
from ...core.latents import seeded_noise
from ...core.units import PipelineUnit
from ...errors import UserError
from ...media.image import images_to_tensor

DIVISION_FACTOR = 16  # VAE x8, then 2x2 patches
VAE_SCALE = 8
LATENT_CHANNELS = 16
MAX_SEQUENCE_LENGTH = 512
EDIT_IMAGE_MAX_PIXELS = 1024 * 1024


# -- shared maths -------------------------------------------------------------------------------------

def vae_encode(pipe, images: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [-1, 1] -> Z-Image latents (z - shift) * scale, the posterior mode (deterministic)."""
    vae = pipe.vae
    z = vae.encode(images.to(device=pipe.device, dtype=vae.dtype)).latent_dist.mode()
    return ((z - vae.config.shift_factor) * vae.config.scaling_factor).to(pipe.torch_dtype)


def vae_decode(pipe, latents: torch.Tensor) -> torch.Tensor:
    vae = pipe.vae
    z = latents.to(vae.dtype) / vae.config.scaling_factor + vae.config.shift_factor
    return vae.decode(z).sample


def prompt_pieces(prompt: str, num_images: int) -> list[str]:
    """The texts one prompt is encoded as: Qwen3's chat template for one user turn (what `apply_chat_template`
    renders with `enable_thinking=True`), or, with edit images, Omni-Base's pieces around each image's slot."""
    if num_images == 0:
        return [f"<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n"]
    return (["<|im_start|>user\n<|vision_start|>"] + ["<|vision_end|><|vision_start|>"] * (num_images - 1)
            + [f"<|vision_end|>{prompt}<|im_end|>\n<|im_start|>assistant\n<|vision_start|>", "<|vision_end|><|im_end|>"])


def encode_texts(pipe, texts: list[str]) -> list[torch.Tensor]:
    """Each text's second-to-last hidden states over its real tokens (padded to 512 tokens, as diffusers)."""
    if pipe.tokenizer is None:
        raise UserError("no tokenizer: pass --tokenizer_path (the model's tokenizer/ folder) to encode prompts")
    tokens = pipe.tokenizer(texts, padding="max_length", max_length=MAX_SEQUENCE_LENGTH, truncation=True,
                            return_tensors="pt")
    ids = tokens.input_ids.to(pipe.device)
    mask = tokens.attention_mask.to(pipe.device).bool()
    # The backbone alone: the LM head's logits (512 x 152k per text at the real size) are never read.
    encoder = getattr(pipe.text_encoder, "model", pipe.text_encoder)
    hidden = encoder(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states[-2]
    return [h[m] for h, m in zip(hidden, mask)]


def _as_lists(edit_image, batch_size: int) -> list[list[Image.Image]] | None:
    """Edit images per sample: an image or a list of images is every sample's; a list of lists one per sample."""
    if edit_image is None:
        return None
    if isinstance(edit_image, Image.Image):
        return [[edit_image]] * batch_size
    items = list(edit_image)
    if items and all(isinstance(i, Image.Image) for i in items):
        return [items] * batch_size
    if len(items) == batch_size and all(isinstance(i, (list, tuple)) or isinstance(i, Image.Image) for i in items):
        return [[i] if isinstance(i, Image.Image) else list(i) for i in items]
    raise UserError(f"edit_image must be an image, a list of images, or one list per prompt (got "
                    f"{type(edit_image).__name__} for {batch_size} prompt(s))")


def edit_image_size(width: int, height: int, max_pixels: int = EDIT_IMAGE_MAX_PIXELS) -> tuple[int, int]:
    """The reference's automatic edit-image size: at most `max_pixels`, sides floored to multiples of 16."""
    scale = min(1.0, (max_pixels / (width * height)) ** 0.5)
    w, h = int(width * scale), int(height * scale)
    return max(DIVISION_FACTOR, w // DIVISION_FACTOR * DIVISION_FACTOR), \
        max(DIVISION_FACTOR, h // DIVISION_FACTOR * DIVISION_FACTOR)


def resize_edit_image(image: Image.Image) -> Image.Image:
    """Scale down to the size above and centre-crop the rest (no change for a small image of 16-multiples)."""
    image = image.convert("RGB")
    w, h = edit_image_size(*image.size)
    if (w, h) == image.size:
        return image
    scale = max(w / image.width, h / image.height)
    resized = image.resize((max(w, round(image.width * scale)), max(h, round(image.height * scale))), Image.BILINEAR)
    left, top = (resized.width - w) // 2, (resized.height - h) // 2
    return resized.crop((left, top, left + w, top + h))


# -- units --------------------------------------------------------------------------------------------

class ZImageShapeChecker(ShapeChecker):
    """Round height and width up to multiples of 16 (VAE x8 and 2x2 patches)."""


class ZImageNoiseInitializer(PipelineUnit):
    """Initial noise (B, 16, H/8, W/8) from `seed`, drawn on the CPU so a seed gives the same noise anywhere."""

    inputs = ("height", "width", "seed", "batch_size")
    outputs = ("noise",)

    def process(self, pipe, height, width, seed, batch_size):
        noise = seeded_noise((LATENT_CHANNELS, height // VAE_SCALE, width // VAE_SCALE), seed, batch_size)
        return {"noise": noise.to(device=pipe.device, dtype=pipe.torch_dtype)}


class ZImageInputImageEmbedder(InputImageEmbedder):
    encode = staticmethod(vae_encode)


class ZImagePromptEmbedder(PipelineUnit):
    """The prompt through Qwen3 (with Omni-Base's image slots when the sample has edit images)."""

    inputs = ("edit_image", "batch_size")
    cfg_inputs = {"prompt": ("prompt", "negative_prompt")}
    cfg_outputs = {"prompt_embeds": ("prompt_embeds", "negative_prompt_embeds"),
                   "prompt_embeds_mask": ("prompt_embeds_mask", "negative_prompt_embeds_mask"),
                   "prompt_pieces": ("prompt_pieces", "negative_prompt_pieces")}
    models = ("text_encoder",)
    batching = {"prompt_embeds": Pad("prompt_embeds_mask")}

    def process(self, pipe, prompt, edit_image, batch_size):
        if prompt is None:
            return {}
        prompts = [prompt] if isinstance(prompt, str) else ["" if p is None else p for p in prompt]
        per_sample = _as_lists(edit_image, len(prompts))
        counts = [0] * len(prompts) if per_sample is None else [len(s) for s in per_sample]
        texts = [prompt_pieces(p, n) for p, n in zip(prompts, counts)]
        encoded = encode_texts(pipe, [t for pieces in texts for t in pieces])
        rows, lengths, at = [], [], 0
        for pieces in texts:
            parts = encoded[at: at + len(pieces)]
            at += len(pieces)
            rows.append(torch.cat(parts))
            lengths.append([p.shape[0] for p in parts])
        length = max(r.shape[0] for r in rows)
        embeds = torch.stack([torch.nn.functional.pad(r, (0, 0, 0, length - r.shape[0])) for r in rows])
        mask = torch.stack([torch.arange(length, device=embeds.device) < r.shape[0] for r in rows]).long()
        out = {"prompt_embeds": embeds.to(pipe.torch_dtype), "prompt_embeds_mask": mask}
        if per_sample is not None:  # Omni-Base: where each piece ends
            out["prompt_pieces"] = torch.tensor(lengths, device=embeds.device)
        return out


class ZImageEditImageEmbedder(PipelineUnit):
    """Omni-Base image(s)-to-image: each edit image, resized as the reference does, VAE-encoded at its own size."""

    feature = "edit"
    inputs = ("edit_image", "batch_size")
    outputs = ("edit_image", "edit_latents")
    models = ("vae",)
    batching = {"edit_latents": LIST}

    def process(self, pipe, edit_image, batch_size):
        per_sample = _as_lists(edit_image, int(batch_size or 1))
        if per_sample is None:
            return {}
        resized = [[resize_edit_image(i) for i in images] for images in per_sample]
        latents = [[vae_encode(pipe, images_to_tensor([i]))[0] for i in images] for images in resized]
        return {"edit_image": resized, "edit_latents": latents}


class ZImageSiglipEmbedder(PipelineUnit):
    """Omni-Base: each edit image's SigLIP2 features on its patch grid (h, w, C), as diffusers'
    `prepare_siglip_embeds`."""

    feature = "edit"
    inputs = ("edit_image", "batch_size")
    outputs = ("siglip_embeds",)
    models = ("image_encoder",)
    batching = {"siglip_embeds": LIST}

    def process(self, pipe, edit_image, batch_size):
        per_sample = _as_lists(edit_image, int(batch_size or 1))
        if per_sample is None:
            return {}
        encoder = pipe.image_encoder
        processor = pipe.siglip_processor or siglip_processor_for(encoder)
        out = []
        for images in per_sample:
            feats = []
            for image in images:
                inputs = processor(images=[image], return_tensors="pt")
                inputs = {k: v.to(pipe.device) for k, v in inputs.items()}
                inputs["pixel_values"] = inputs["pixel_values"].to(encoder.dtype)
                h, w = (int(s) for s in inputs["spatial_shapes"][0])
                hidden = encoder(**inputs).last_hidden_state
                feats.append(hidden[0, : h * w].reshape(h, w, -1).to(pipe.torch_dtype))
            out.append(feats)
        return {"siglip_embeds": out}


def siglip_processor_for(encoder):
    """The SigLIP2 image processor Omni-Base uses (the reference builds it in code): mean/std 0.5, bilinear,
    at most the model's `num_patches` patches of its `patch_size`."""
    from transformers import Siglip2ImageProcessor

    cfg = encoder.config
    return Siglip2ImageProcessor(patch_size=cfg.patch_size, max_num_patches=cfg.num_patches, image_mean=[0.5] * 3,
                                 image_std=[0.5] * 3, resample=2, do_resize=True, do_rescale=True,
                                 do_normalize=True)


class ZImageControlEmbedder(PipelineUnit):
    """The Fun ControlNet's control context (B, 33, 1, h, w): the control image's latents, the inpaint mask (1 where
    to paint) and the inpaint image's latents, the reference's layout. Without an inpaint image the reference
    encodes an all-zero image (mid grey), which is what its training saw; `control_inpaint_latents="zeros"` gives
    diffusers' (and VideoX-Fun's) zero latents instead."""

    feature = "controlnet"
    inputs = ("controlnet_image", "controlnet_inpaint_mask", "controlnet_inpaint_image", "height", "width",
              "batch_size", "control_inpaint_latents")
    outputs = ("control_context",)
    models = ("vae",)

    def process(self, pipe, controlnet_image, controlnet_inpaint_mask, controlnet_inpaint_image, height, width,
                batch_size, control_inpaint_latents):
        if controlnet_image is None and controlnet_inpaint_mask is None:
            return {}
        b = int(batch_size or 1)
        h, w = height // VAE_SCALE, width // VAE_SCALE
        if controlnet_image is not None:
            control = vae_encode(pipe, images_to_tensor(_batch_images(controlnet_image, b), height, width))
        else:
            control = torch.full((b, LATENT_CHANNELS, h, w), -1.0, device=pipe.device, dtype=pipe.torch_dtype)
        if controlnet_inpaint_mask is not None:
            mask = images_to_tensor(_batch_images(controlnet_inpaint_mask, b), height, width).float() / 2 + 0.5
            image = images_to_tensor(_batch_images(controlnet_inpaint_image, b), height, width).float()
            image = image.to(mask.device) * (mask < 0.5)
            mask = torch.nn.functional.interpolate(1 - mask, (h, w), mode="nearest")[:, :1]
        else:
            mask = torch.zeros((b, 1, h, w))
            image = torch.zeros((b, 3, height, width))
        if control_inpaint_latents == "zeros" and controlnet_inpaint_mask is None:
            inpaint = torch.zeros_like(control)
        else:
            inpaint = vae_encode(pipe, image)
        mask = mask.to(device=pipe.device, dtype=pipe.torch_dtype)
        context = torch.cat([control, mask, inpaint.to(control.device)], dim=1)
        return {"control_context": context.unsqueeze(2)}


def _batch_images(images, batch_size: int) -> list[Image.Image]:
    if images is None:
        raise UserError("controlnet_inpaint_mask needs controlnet_inpaint_image (the image to paint into)")
    items = [images] if isinstance(images, Image.Image) else list(images)
    if len(items) == 1:
        items = items * batch_size
    if len(items) != batch_size or not all(isinstance(i, Image.Image) for i in items):
        raise UserError(f"controlnet images: expected one image or one per prompt ({batch_size}), got {len(items)}")
    return items
