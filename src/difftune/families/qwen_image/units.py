"""Qwen-Image's units: size check, noise, input image, edit image, prompt (with the chat template).

Values keep a leading batch dimension; prompt embeddings of a batch are padded and masked.
"""

from __future__ import annotations

import math

import torch
from PIL import Image

from ...core.batch import LIST, Pad
from ...core.latents import seeded_noise
from ...core.common_units import InputImageEmbedder, ShapeChecker
from ...core.units import PipelineUnit
from ...media.image import as_image_list, images_to_tensor

PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the image by detailing the color, shape, size, texture, quantity, "
                   "text, spatial relationships of the objects and background:<|im_end|>\n<|im_start|>user\n{}"
                   "<|im_end|>\n<|im_start|>assistant\n")
EDIT_PROMPT_TEMPLATE = ("<|im_start|>system\nDescribe the key features of the input image (color, shape, size, "
                        "texture, objects, background), then explain how the user's text instruction should alter or "
                        "modify the image. Generate a new image that meets the user's requirements while maintaining "
                        "consistency with the original input where appropriate.<|im_end|>\n<|im_start|>user\n"
                        "<|vision_start|><|image_pad|><|vision_end|>{}<|im_end|>\n<|im_start|>assistant\n")
TOKENIZER_MAX_LENGTH = 1024
MAX_SEQUENCE_LENGTH = 512
DIVISION_FACTOR = 16  # VAE x8, then 2x2 patches
VAE_SCALE = 8
EDIT_IMAGE_AREA = 1024 * 1024



def template_drop_count(tokenizer, template: str) -> int:
    """How many leading template tokens to drop from the text encoder's output.

    The official pipelines hard-code 34 (text-to-image) and 64 (edit), which is right only for the
    official tokenizer. This counts the tokens of the template's system part (everything before the
    first placeholder: the prompt `{}` or the image `<|vision_start|>`) with the tokenizer at hand.
    """
    cut = min(i for i in (template.find("{}"), template.find("<|vision_start|>")) if i >= 0)
    return len(tokenizer(template[:cut], add_special_tokens=False)["input_ids"])


def edit_image_size(width: int, height: int, area: int = EDIT_IMAGE_AREA) -> tuple[int, int]:
    """Qwen-Image-Edit's automatic resize: keep the aspect ratio, about `area` pixels, sides multiples of 32."""
    ratio = width / height
    w = math.sqrt(area * ratio)
    h = w / ratio
    return max(32, round(w / 32) * 32), max(32, round(h / 32) * 32)


def _latent_stats(vae, dtype, device):
    mean = torch.tensor(vae.config.latents_mean, dtype=dtype, device=device).view(1, -1, 1, 1)
    std = torch.tensor(vae.config.latents_std, dtype=dtype, device=device).view(1, -1, 1, 1)
    return mean, std


def vae_encode(pipe, images: torch.Tensor) -> torch.Tensor:
    """(B, 3, H, W) in [-1, 1] -> normalised latents (B, 16, H/8, W/8), the posterior mode (deterministic)."""
    vae = pipe.vae
    x = images.to(device=pipe.device, dtype=vae.dtype).unsqueeze(2)  # the VAE is a video VAE: one frame
    z = vae.encode(x).latent_dist.mode()[:, :, 0]
    mean, std = _latent_stats(vae, z.dtype, z.device)
    return ((z - mean) / std).to(pipe.torch_dtype)


def vae_decode(pipe, latents: torch.Tensor) -> torch.Tensor:
    vae = pipe.vae
    latents = latents.to(vae.dtype)
    mean, std = _latent_stats(vae, latents.dtype, latents.device)
    return vae.decode((latents * std + mean).unsqueeze(2)).sample[:, :, 0]


# -- units --------------------------------------------------------------------------------------------


class QwenImageShapeChecker(ShapeChecker):
    """Round height and width up to multiples of 16 (VAE x8 and 2x2 patches)."""


class QwenImageNoiseInitializer(PipelineUnit):
    """Initial noise from `seed`, drawn on `rand_device` so a seed gives the same noise on any accelerator."""

    inputs = ("height", "width", "seed", "rand_device", "batch_size", "layer_num")
    outputs = ("noise",)

    def process(self, pipe, height, width, seed, rand_device, batch_size, layer_num):
        rand_device = rand_device or "cpu"
        if isinstance(rand_device, (list, tuple)):
            rand_device = rand_device[0]
        if layer_num is not None:  # Qwen-Image-Layered: (B, 16, layers + 1, h, w), see layered.py
            from .layered import layered_noise

            return {"noise": layered_noise(pipe, height, width, seed, rand_device, batch_size, layer_num)}
        noise = seeded_noise((16, height // VAE_SCALE, width // VAE_SCALE), seed, batch_size, rand_device)
        return {"noise": noise.to(device=pipe.device, dtype=pipe.torch_dtype)}


class QwenImageInputImageEmbedder(InputImageEmbedder):
    encode = staticmethod(vae_encode)


class QwenImageEditImageEmbedder(PipelineUnit):
    """Qwen-Image-Edit: resize the edit image to about 1 MP (unless told not to) and encode it."""

    inputs = ("edit_image", "edit_image_auto_resize", "batch_size")
    outputs = ("edit_image", "edit_latents")
    models = ("vae",)
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


class QwenImagePromptEmbedder(PipelineUnit):
    """Encode the prompt with the Qwen-Image chat template (with the edit image for Qwen-Image-Edit)."""

    inputs = ("edit_image",)
    cfg_inputs = {"prompt": ("prompt", "negative_prompt")}
    cfg_outputs = {"prompt_embeds": ("prompt_embeds", "negative_prompt_embeds"),
                   "prompt_embeds_mask": ("prompt_embeds_mask", "negative_prompt_embeds_mask")}
    models = ("text_encoder",)
    batching = {"prompt_embeds": Pad("prompt_embeds_mask")}  # prompts of a batch differ in length

    def process(self, pipe, prompt, edit_image):
        if prompt is None:
            return {}
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        encoder = pipe.text_encoder
        from .edit_plus import EDIT_PLUS_PROMPT_TEMPLATE, edit_groups, edit_plus_vl_inputs

        groups = edit_groups(edit_image, len(prompts))
        if groups is not None:  # Edit-Plus: "Picture i" per image
            template = EDIT_PLUS_PROMPT_TEMPLATE
            tokens, extra = edit_plus_vl_inputs(pipe, prompts, groups)
        elif edit_image is None:
            template = PROMPT_TEMPLATE
            tokens = pipe.tokenizer([template.format(p) for p in prompts], max_length=TOKENIZER_MAX_LENGTH +
                                    pipe.template_drop(template), padding=True, truncation=True, return_tensors="pt")
            extra = {}
        else:
            template = EDIT_PROMPT_TEMPLATE
            tokens, extra = pipe.vl_inputs([template.format(p) for p in prompts], as_image_list(edit_image))
        tokens = {k: v.to(pipe.device) for k, v in tokens.items()}
        extra = {k: v.to(pipe.device) for k, v in extra.items()}
        if "pixel_values" in extra:
            extra["pixel_values"] = extra["pixel_values"].to(encoder.dtype)
        # The base model's last hidden state (after the final norm) is what the DiT reads; going round the
        # LM head saves a (tokens x 152k-vocabulary) logits tensor per batch at the real size.
        backbone = getattr(encoder, "model", encoder)
        hidden = backbone(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"],
                          **extra).last_hidden_state
        drop = pipe.template_drop(template)
        # Only text prompts are cut (as diffusers): an edit prompt's image tokens come first and often pass it.
        limit = MAX_SEQUENCE_LENGTH if edit_image is None else None
        pieces = [h[m.bool()][drop:][:limit] for h, m in zip(hidden, tokens["attention_mask"])]
        length = max(p.shape[0] for p in pieces)
        embeds = torch.stack([torch.nn.functional.pad(p, (0, 0, 0, length - p.shape[0])) for p in pieces])
        mask = torch.stack([torch.arange(length, device=embeds.device) < p.shape[0] for p in pieces]).long()
        return {"prompt_embeds": embeds.to(pipe.torch_dtype), "prompt_embeds_mask": mask}
