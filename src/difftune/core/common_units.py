"""Units whose maths several families share. A family subclasses them under its own name (unit names are part
of a cache's fingerprint) and supplies what differs, e.g. how its VAE normalises latents."""

from __future__ import annotations

import torch

from ..errors import UserError
from ..media.image import images_to_tensor
from .batch import Pad
from .latents import seeded_noise
from .units import PipelineUnit


class ShapeChecker(PipelineUnit):
    """Round height and width up to multiples of the target's primary stream's `division`."""

    inputs = ("height", "width")
    outputs = ("height", "width")

    def process(self, pipe, height, width):
        if height is None or width is None:
            raise UserError("height and width are required (or an input image to take them from)")
        f = pipe.stream.division
        return {"height": -(-int(height) // f) * f, "width": -(-int(width) // f) * f}


class NoiseInitializer(PipelineUnit):
    """Initial noise of the target's primary stream (its `noise_shape` for the size) from `seed`, drawn on
    `rand_device` (the CPU by default, so a seed gives the same noise anywhere)."""

    inputs = ("height", "width", "seed", "batch_size", "rand_device")
    outputs = ("noise",)

    def process(self, pipe, height, width, seed, batch_size, rand_device):
        noise = seeded_noise(pipe.stream.noise_shape(pipe, height, width), seed, batch_size,
                             device=rand_device or "cpu")
        return {"noise": noise.to(device=pipe.device, dtype=pipe.torch_dtype)}


class InputImageEmbedder(PipelineUnit):
    """Encode the input image: clean latents in training; noised to the first timestep for image-to-image.

    `encode(pipe, images)` is the family's VAE encode (normalisation included); it is called with the unit's
    view of the pipeline, so it reaches only the declared models."""

    inputs = ("input_image", "noise", "height", "width")
    outputs = ("latents", "input_latents")
    models = ("vae",)
    encode = None  # staticmethod(vae_encode) in the family's subclass

    def process(self, pipe, input_image, noise, height, width):
        if input_image is None:
            return {"latents": noise}
        input_latents = type(self).encode(pipe, images_to_tensor(input_image, height, width))
        if pipe.scheduler.training:
            return {"latents": noise, "input_latents": input_latents}
        latents = pipe.scheduler.add_noise(input_latents, noise, pipe.scheduler.sigmas[0])
        return {"latents": latents, "input_latents": input_latents}


def prompt_list(prompt) -> list[str]:
    """A prompt or a batch of them as a list of strings (a missing one is empty)."""
    return [prompt] if isinstance(prompt, str) else ["" if p is None else str(p) for p in prompt]


def padded(rows: list[torch.Tensor], dtype) -> dict[str, torch.Tensor]:
    """Prompt rows (L_i, D) of different lengths -> `prompt_embeds` (B, L, D) zero-padded at the end, and
    `prompt_embeds_mask` (B, L) of the real tokens."""
    length = max(r.shape[0] for r in rows)
    embeds = torch.stack([torch.nn.functional.pad(r, (0, 0, 0, length - r.shape[0])) for r in rows])
    mask = torch.stack([torch.arange(length, device=embeds.device) < r.shape[0] for r in rows]).long()
    return {"prompt_embeds": embeds.to(dtype), "prompt_embeds_mask": mask}


class PromptEmbedder(PipelineUnit):
    """The prompt (and the negative prompt) through the text encoder: the family's subclass gives
    `embed(pipe, prompts)` -> its values (`prompt_embeds`, or what its `cfg_outputs` name)."""

    cfg_inputs = {"prompt": ("prompt", "negative_prompt")}
    cfg_outputs = {"prompt_embeds": ("prompt_embeds", "negative_prompt_embeds")}
    models = ("text_encoder",)
    empty: dict = {}  # what a call without a prompt gives

    def process(self, pipe, prompt):
        if prompt is None:
            return dict(self.empty)
        return self.embed(pipe, prompt_list(prompt))

    def embed(self, pipe, prompts: list[str]) -> dict:  # pragma: no cover - the family's
        raise NotImplementedError


class PaddedPromptEmbedder(PromptEmbedder):
    """Each prompt's own tokens, padded to the longest of the batch, with the mask of its real tokens: the family's
    subclass gives `rows(pipe, prompts)` (each prompt's (L_i, D) embeddings), or `embed` for another layout."""

    cfg_outputs = {"prompt_embeds": ("prompt_embeds", "negative_prompt_embeds"),
                   "prompt_embeds_mask": ("prompt_embeds_mask", "negative_prompt_embeds_mask")}
    batching = {"prompt_embeds": Pad("prompt_embeds_mask")}  # prompts of a batch differ in length

    def embed(self, pipe, prompts: list[str]) -> dict:
        return padded(self.rows(pipe, prompts), pipe.torch_dtype)

    def rows(self, pipe, prompts: list[str]) -> list[torch.Tensor]:  # pragma: no cover - the family's
        raise NotImplementedError


class EmbeddedGuidance(PipelineUnit):
    """A guidance-distilled DiT's embedded guidance, one value per sample: the call's (one or one per sample), else
    the family's sampling default (`call_defaults["embedded_guidance"]`); a DiT without a guidance embedder ignores
    it."""

    inputs = ("embedded_guidance", "batch_size")
    outputs = ("guidance",)

    def process(self, pipe, embedded_guidance, batch_size):
        if isinstance(embedded_guidance, (list, tuple)):
            values = [float(g) for g in embedded_guidance]
        else:
            g = pipe.call_defaults["embedded_guidance"] if embedded_guidance is None else float(embedded_guidance)
            values = [g] * int(batch_size or 1)
        return {"guidance": torch.tensor(values, dtype=torch.float32, device=pipe.device)}
