"""FLUX.1's units: size check, noise, input image, Kontext reference images, prompt (CLIP pooled + T5 tokens),
embedded guidance.

Values keep a leading batch dimension. The T5 prompt is padded to a fixed 512 tokens (as diffusers'
FluxPipeline and the reference's `t5_sequence_length`), so prompts of a batch always stack.
"""

from __future__ import annotations

import torch
from PIL import Image

from ...core.latents import pack_latents, seeded_noise
from ...core.common_units import InputImageEmbedder, ShapeChecker
from ...core.units import PipelineUnit
from ...errors import UserError
from ...media.image import images_to_tensor
from ...parts.flux_ae import LATENT_CHANNELS, VAE_SCALE, vae_encode

DIVISION_FACTOR = 16  # VAE x8, then 2x2 patches
CLIP_MAX_LENGTH = 77
T5_MAX_LENGTH = 512


def _prompts(prompt) -> list[str]:
    return [prompt] if isinstance(prompt, str) else ["" if p is None else p for p in prompt]


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

    inputs = ("kontext_images", "batch_size")
    outputs = ("kontext_latents", "kontext_ids")
    models = ("vae",)
    feature = "kontext"

    def process(self, pipe, kontext_images, batch_size):
        if kontext_images is None:
            return {}
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


class FluxClipEmbedder(PipelineUnit):
    """The pooled CLIP embedding of the prompt (diffusers' encode_prompt, first half). A unit of its own so
    that training one text encoder moves only its unit to stage 2 (T5-XXL stays in stage 1)."""

    cfg_inputs = {"prompt": ("prompt", "negative_prompt")}
    cfg_outputs = {"pooled_prompt_embeds": ("pooled_prompt_embeds", "negative_pooled_prompt_embeds")}
    models = ("text_encoder",)

    def process(self, pipe, prompt):
        if prompt is None:
            return {}
        return {"pooled_prompt_embeds": clip_pooled(pipe, _prompts(prompt)).to(pipe.torch_dtype)}


class FluxT5Embedder(PipelineUnit):
    """The T5 token embeddings of the prompt, padded to 512 tokens (diffusers' encode_prompt, second half)."""

    cfg_inputs = {"prompt": ("prompt", "negative_prompt")}
    cfg_outputs = {"prompt_embeds": ("prompt_embeds", "negative_prompt_embeds")}
    models = ("text_encoder_2",)

    def process(self, pipe, prompt):
        if prompt is None:
            return {}
        return {"prompt_embeds": t5_hidden(pipe, _prompts(prompt)).to(pipe.torch_dtype)}


class FluxEmbeddedGuidance(PipelineUnit):
    """FLUX.1-dev's distilled guidance, one value per sample (the transformer ignores it without a guidance
    embedder, e.g. schnell)."""

    inputs = ("embedded_guidance", "batch_size")
    outputs = ("guidance",)

    def process(self, pipe, embedded_guidance, batch_size):
        if isinstance(embedded_guidance, (list, tuple)):
            values = [float(g) for g in embedded_guidance]
        else:
            g = pipe.call_defaults["embedded_guidance"] if embedded_guidance is None else float(embedded_guidance)
            values = [g] * int(batch_size or 1)
        return {"guidance": torch.tensor(values, dtype=torch.float32, device=pipe.device)}
