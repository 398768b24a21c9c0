"""`ErnieImagePipeline`: ERNIE-Image (text-to-image, and image-to-image from an input image): inference and the
training hooks. The reference trains it on images and prompts only, so the pipeline has no features; the row, the
call and the stage-1 batches are the base pipeline's, from its target (images)."""

from __future__ import annotations

import json
from pathlib import Path

from ...core.pipeline import PromptImagePipeline
from ...core.target import ImageStream, Target
from ...errors import UserError
from ...parts import flux2_vae
from .components import BN_EPS, SCHEDULER_CONFIG
from .model_fn import model_fn_ernie_image
from .prompt import ErnieImagePromptEmbedder
from .units import DIVISION_FACTOR, ErnieImageInputImageEmbedder, ErnieImageNoiseInitializer, ErnieImageShapeChecker

# Every sampling default of the family (diffusers' ErnieImagePipeline and the reference's: 50 steps, guidance 4;
# `cfg_scale` is both the reference's and diffusers' `guidance_scale`: nega + s * (posi - nega)).
CALL_DEFAULTS = {"height": 1024, "width": 1024, "num_inference_steps": 50, "cfg_scale": 4.0}


def _decode(pipe, latents):
    return flux2_vae.decode(pipe.vae, latents.to(pipe.device), eps=BN_EPS)


# A Mistral language model's model_type -> its class: the DiT reads Ministral-3's (PaddlePaddle/ERNIE-Image's)
_MISTRAL_CLASSES = {"ministral3": "Ministral3Model", "mistral": "MistralModel", "ministral": "MinistralModel"}


def _text_model_type(encoder) -> str | None:
    """The language model's model_type its own config.json (beside its weights) gives: a Mistral-3 folder's config
    names the multimodal model, which recognition sets aside for the weights (of one layout for every Mistral-3)."""
    try:
        config = json.loads((Path(encoder.files[0]).parent / "config.json").read_text())
    except (OSError, ValueError, IndexError, TypeError):
        config = None
    if not isinstance(config, dict):
        config = encoder.config
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else config
    return text.get("model_type")


class ErnieImagePipeline(PromptImagePipeline):
    call_defaults = CALL_DEFAULTS
    # the VAE's x8 and the 2x2 patches are the VAE side's: the DiT sees one token per latent pixel
    target = Target((ImageStream(channels=flux2_vae.PATCHED_CHANNELS, scale=DIVISION_FACTOR, patch=1,
                                 division=DIVISION_FACTOR, decoder=_decode),))
    scheduler_config = SCHEDULER_CONFIG  # a static shift of 3, which the reference also trains at
    base_units = (ErnieImageShapeChecker, ErnieImageNoiseInitializer, ErnieImageInputImageEmbedder,
                  ErnieImagePromptEmbedder)

    @classmethod
    def check_models(cls, models) -> None:
        """The DiT reads Ministral-3's second-to-last hidden states, text_in_dim wide."""
        dit, encoder = models.get("dit"), models.get("text_encoder")
        if dit is None or encoder is None:
            return
        kind = _text_model_type(encoder)
        if kind in _MISTRAL_CLASSES and kind != "ministral3":
            raise UserError(f"the text_encoder {encoder.describe()} is a {_MISTRAL_CLASSES[kind]} (its config.json: "
                            f"model_type '{kind}') and the dit {dit.describe()} reads a Ministral3Model's hidden "
                            f"states: give the ERNIE-Image DiT its own text encoder (Ministral-3 3B)")
        width, wanted = encoder.config["hidden_size"], dit.config["text_in_dim"]
        if width != wanted:
            raise UserError(f"the text_encoder {encoder.describe()} is {width} wide and the dit {dit.describe()} "
                            f"reads {wanted}-wide hidden states (text_in_dim): give the ERNIE-Image DiT its own text "
                            f"encoder (Ministral-3 3B)")
        depth = encoder.config["num_hidden_layers"]
        if depth < 2:  # hidden_states[0] is the embedding output
            raise UserError(f"the text_encoder {encoder.describe()} has {depth} layer{'s' if depth != 1 else ''} and "
                            f"the dit {dit.describe()} reads its second-to-last layer's hidden states: give the "
                            f"ERNIE-Image DiT its own text encoder (Ministral-3 3B)")

    def model_fn(self, latents, timestep, prompt_embeds, prompt_embeds_mask=None, **inputs):
        if self.dit is None:
            raise UserError("no ERNIE-Image DiT loaded")
        return model_fn_ernie_image(self.dit, latents, timestep, prompt_embeds, prompt_embeds_mask, **inputs)

    def set_timesteps(self, values, num_inference_steps: int, denoising_strength: float = 1.0) -> None:
        """A static shift of 3 over linspace(1, 1/N, N) (diffusers' pipeline); image-to-image takes the reference's
        schedule (all steps from sigma = strength)."""
        self.scheduler.set_timesteps(num_inference_steps, denoising_strength=denoising_strength,
                                     strength_mode="diffsynth" if denoising_strength < 1 else "diffusers")


__all__ = ["CALL_DEFAULTS", "ErnieImagePipeline"]
