"""What Qwen-Image's units and model_fn share: the prompt templates and limits, the VAE's normalised
encode/decode (RGB, and RGBA for Qwen-Image-Layered's VAE), the edit image's automatic size, and the
transformer's zero_cond_t switch. Kept apart from the units so feature modules (edit_plus, layered, context,
eligen) build on it without importing each other."""

from __future__ import annotations

import math

import torch

from ...errors import UserError
from ...media.image import images_to_tensor
from ...parts.qwen_image_vae import vae_decode, vae_encode  # noqa: F401 - the units and features import them here

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


def check_rgba_vae(pipe) -> None:
    channels = getattr(pipe.vae.config, "input_channels", 3)
    if channels != 4:
        raise UserError(f"Qwen-Image-Layered needs its RGBA VAE (Qwen/Qwen-Image-Layered:vae/...); the VAE loaded "
                        f"reads {channels} channels")


def encode_rgba(pipe, images, height, width) -> torch.Tensor:
    check_rgba_vae(pipe)
    # one image at a time, as the reference encodes a stack (a stack of large layers is a large batch)
    return torch.cat([vae_encode(pipe, images_to_tensor([img], height, width, mode="RGBA")) for img in images])


def set_zero_cond_t(dit, enabled: bool) -> None:
    """Turn diffusers' own zero_cond_t handling on in the transformer and its blocks (it changes no weight, so
    bare Edit-2511 files, loaded with the Qwen-Image config, need it from the flag)."""
    want = bool(enabled) or bool(getattr(getattr(dit, "config", None), "zero_cond_t", False))
    if getattr(dit, "_difftune_zero_cond_t", None) == want:
        return
    for module in dit.modules():
        if hasattr(module, "zero_cond_t"):
            module.zero_cond_t = want
    dit._difftune_zero_cond_t = want
