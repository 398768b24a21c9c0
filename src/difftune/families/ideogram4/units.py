"""Ideogram-4's units: the size check, the noise, the input image through the FLUX.2 autoencoder and the prompt
through Qwen3-VL.

Latents are kept as (B, 128, H/16, W/16): the autoencoder's 32 channels in 2x2 patches, patch-major (channel index
(2p + q) * 32 + c, Ideogram's token layout) and normalised by the autoencoder's BatchNorm statistics in that order, as
diffusers' Ideogram4Pipeline un-normalises them. Row-major, these are the DiT's image tokens.
"""

from __future__ import annotations

import torch

from ...core.common_units import InputImageEmbedder, PaddedPromptEmbedder, ShapeChecker
from ...core.latents import seeded_noise
from ...core.units import PipelineUnit
from ...errors import UserError
from ...parts.flux2_vae import LATENT_CHANNELS, PATCH, VAE_SCALE, bn_stats, from_patch_major_tokens, \
    patch_major_tokens

DIVISION_FACTOR = VAE_SCALE * PATCH  # 16
TOKEN_CHANNELS = LATENT_CHANNELS * PATCH * PATCH  # 128
# The Qwen3-VL decoder layers whose outputs, side by side, are the DiT's text features (13 x 4096 = 53248).
ACTIVATION_LAYERS = (0, 3, 6, 9, 12, 15, 18, 21, 24, 27, 30, 33, 35)
MAX_TEXT_TOKENS = 2048


def tokens_to_grid(tokens: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """(B, h*w, C) row-major tokens -> (B, C, h, w)."""
    b, _, c = tokens.shape
    return tokens.transpose(1, 2).reshape(b, c, height, width)


def grid_to_tokens(latents: torch.Tensor) -> torch.Tensor:
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h * w).transpose(1, 2)


def vae_encode(pipe, images: torch.Tensor) -> torch.Tensor:
    """Images (B, 3, H, W) in [-1, 1] -> normalised patch-major latents (B, 128, H/16, W/16) (the posterior's mode)."""
    vae = pipe.vae
    z = vae.encode(images.to(device=pipe.device, dtype=vae.dtype)).latent_dist.mode().float()
    mean, std = bn_stats(vae, device=z.device)
    tokens = (patch_major_tokens(z) - mean) / std
    return tokens_to_grid(tokens, z.shape[-2] // PATCH, z.shape[-1] // PATCH)


def vae_decode(pipe, latents: torch.Tensor) -> torch.Tensor:
    """The inverse of `vae_encode`, as diffusers' Ideogram4Pipeline decodes."""
    vae = pipe.vae
    mean, std = bn_stats(vae, device=latents.device)
    tokens = grid_to_tokens(latents.float()) * std + mean
    h, w = latents.shape[-2:]
    z = from_patch_major_tokens(tokens, h * PATCH, w * PATCH)
    return vae.decode(z.to(vae.dtype), return_dict=False)[0]


class Ideogram4ShapeChecker(ShapeChecker):
    """Round height and width up to multiples of 16 (VAE x8, then 2x2 patches)."""


class Ideogram4NoiseInitializer(PipelineUnit):
    """Initial noise drawn as the reference draws it, (B, h*w, 128) tokens from `seed` on `rand_device` (the CPU by
    default), kept as (B, 128, h, w)."""

    inputs = ("height", "width", "seed", "batch_size", "rand_device")
    outputs = ("noise",)

    def process(self, pipe, height, width, seed, batch_size, rand_device):
        h, w = height // DIVISION_FACTOR, width // DIVISION_FACTOR
        tokens = seeded_noise((h * w, TOKEN_CHANNELS), seed, batch_size, device=rand_device or "cpu")
        return {"noise": tokens_to_grid(tokens, h, w).to(device=pipe.device, dtype=pipe.torch_dtype)}


class Ideogram4InputImageEmbedder(InputImageEmbedder):
    encode = staticmethod(vae_encode)


def chat_text(tokenizer, prompt: str) -> str:
    messages = [{"role": "user", "content": [{"type": "text", "text": prompt}]}]
    return tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def text_features(pipe, prompt: str) -> torch.Tensor:
    """One prompt (a user turn of the chat template) -> its tokens' features (n, hidden * 13): the outputs of the
    `ACTIVATION_LAYERS` decoder layers, interleaved per hidden unit, as diffusers' pipeline and the reference read
    them."""
    if pipe.tokenizer is None:
        raise UserError("no tokenizer: pass --tokenizer_path (Ideogram-4's tokenizer/ folder) to encode prompts")
    ids = pipe.tokenizer(chat_text(pipe.tokenizer, prompt), return_tensors="pt", add_special_tokens=False).input_ids
    if ids.shape[1] > MAX_TEXT_TOKENS:
        raise UserError(f"a prompt of {ids.shape[1]} tokens: Ideogram-4 takes at most {MAX_TEXT_TOKENS}")
    model = pipe.text_encoder.language_model
    if len(model.layers) <= ACTIVATION_LAYERS[-1]:
        raise UserError(f"the text encoder has {len(model.layers)} layers; Ideogram-4 reads layers up to "
                        f"{ACTIVATION_LAYERS[-1]} (Qwen3-VL-8B's 36)")
    captured = {}
    hooks = [model.layers[i].register_forward_hook(lambda _m, _a, out, i=i: captured.__setitem__(
        i, out[0] if isinstance(out, tuple) else out)) for i in ACTIVATION_LAYERS]
    try:
        model(input_ids=ids.to(pipe.device), use_cache=False)
    finally:
        for hook in hooks:
            hook.remove()
    # interleaved: feature index = hidden unit * 13 + layer
    return torch.stack([captured[i][0] for i in ACTIVATION_LAYERS], dim=-1).flatten(1).float()


class Ideogram4PromptEmbedder(PaddedPromptEmbedder):
    """Each prompt's text features (B, L, D), right-padded with a mask. The unconditional side of guidance reads no
    prompt (Ideogram-4 has no negative prompt: an unconditional DiT, or the DiT with no text, makes it): its value is
    None, which `model_fn` runs as the image-only sequence."""

    cfg_inputs = {"prompt": ("prompt", "unconditional_prompt")}
    empty = {"prompt_embeds": None, "prompt_embeds_mask": None}

    def rows(self, pipe, prompts):
        return [text_features(pipe, p) for p in prompts]


__all__ = ["ACTIVATION_LAYERS", "DIVISION_FACTOR", "Ideogram4InputImageEmbedder", "Ideogram4NoiseInitializer",
           "Ideogram4PromptEmbedder", "Ideogram4ShapeChecker", "TOKEN_CHANNELS", "grid_to_tokens", "text_features",
           "tokens_to_grid", "vae_decode", "vae_encode"]
