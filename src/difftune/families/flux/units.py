"""FLUX.1's base units: size check, noise, input image, prompt (CLIP pooled + T5 tokens), embedded guidance.

Values keep a leading batch dimension. The T5 prompt is padded to a fixed 512 tokens (as diffusers'
FluxPipeline and the reference's `t5_sequence_length`), so prompts of a batch always stack.
"""

from __future__ import annotations

import torch
from ...core.latents import seeded_noise
from ...core.common_units import EmbeddedGuidance, InputImageEmbedder, PromptEmbedder, ShapeChecker
from ...core.units import PipelineUnit
from ...errors import UserError
from ...parts.flux_ae import LATENT_CHANNELS, VAE_SCALE, vae_encode

DIVISION_FACTOR = 16  # VAE x8, then 2x2 patches
CLIP_MAX_LENGTH = 77
T5_MAX_LENGTH = 512


def clip_pooled(pipe, prompts: list[str]) -> torch.Tensor:
    """CLIP's pooled output for prompts padded/truncated to 77 tokens (diffusers' _get_clip_prompt_embeds)."""
    if pipe.tokenizer_1 is None:
        raise UserError("no CLIP tokenizer: pass --tokenizer_1_path (or tokenizer_1_config) to encode prompts")
    ids = pipe.tokenizer_1(prompts, padding="max_length", max_length=CLIP_MAX_LENGTH, truncation=True,
                           return_tensors="pt").input_ids.to(pipe.device)
    return pipe.text_encoder(ids, output_hidden_states=False).pooler_output


def t5_hidden(pipe, prompts: list[str], max_length: int = T5_MAX_LENGTH) -> torch.Tensor:
    """T5's last hidden states for prompts padded/truncated to `max_length` (no attention mask, as FLUX)."""
    if pipe.tokenizer_2 is None:
        raise UserError("no T5 tokenizer: pass --tokenizer_2_path (or tokenizer_2_config) to encode prompts")
    ids = pipe.tokenizer_2(prompts, padding="max_length", max_length=max_length, truncation=True,
                           return_tensors="pt").input_ids.to(pipe.device)
    return pipe.text_encoder_2(ids, output_hidden_states=False)[0]


class FluxShapeChecker(ShapeChecker):
    """Round height and width up to multiples of 16 (VAE x8 and 2x2 patches)."""


class FluxNoiseInitializer(PipelineUnit):
    """Initial noise (B, 16, H/8, W/8) from `seed`, drawn on the CPU so a seed gives the same noise anywhere."""

    inputs = ("height", "width", "seed", "batch_size")
    outputs = ("noise",)

    def process(self, pipe, height, width, seed, batch_size):
        noise = seeded_noise((LATENT_CHANNELS, height // VAE_SCALE, width // VAE_SCALE), seed, batch_size)
        return {"noise": noise.to(device=pipe.device, dtype=pipe.torch_dtype)}


class FluxInputImageEmbedder(InputImageEmbedder):
    encode = staticmethod(vae_encode)


class FluxClipEmbedder(PromptEmbedder):
    """The pooled CLIP embedding of the prompt (diffusers' encode_prompt, first half). A unit of its own so
    that training one text encoder moves only its unit to stage 2 (T5-XXL stays in stage 1)."""

    cfg_outputs = {"pooled_prompt_embeds": ("pooled_prompt_embeds", "negative_pooled_prompt_embeds")}

    def embed(self, pipe, prompts):
        return {"pooled_prompt_embeds": clip_pooled(pipe, prompts).to(pipe.torch_dtype)}


class FluxT5Embedder(PromptEmbedder):
    """The T5 token embeddings of the prompt, padded to 512 tokens (diffusers' encode_prompt, second half)."""

    models = ("text_encoder_2",)

    def embed(self, pipe, prompts):
        return {"prompt_embeds": t5_hidden(pipe, prompts).to(pipe.torch_dtype)}


class FluxEmbeddedGuidance(EmbeddedGuidance):
    """FLUX.1-dev's distilled guidance, one value per sample (the transformer ignores it without a guidance
    embedder, e.g. schnell)."""

