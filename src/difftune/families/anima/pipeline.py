"""`AnimaPipeline`: Anima (text-to-image, image-to-image): inference and the training hooks.

One pipeline with no features: the reference's Anima scripts feed an image and a prompt only. The DiT's call reads
the prompt's Qwen3 states and T5 token ids (prompt.py); the row, the call and the stage-1 batches are the base
pipeline's, from its target (images)."""

from __future__ import annotations

from ...core.pipeline import PromptImagePipeline
from ...core.target import ImageStream, Target
from ...errors import UserError
from ...parts.qwen_image_vae import vae_decode
from .components import SCHEDULER_CONFIG
from .model_fn import model_fn_anima
from .prompt import AnimaPromptEmbedder
from .units import (DIVISION_FACTOR, LATENT_CHANNELS, VAE_SCALE, AnimaInputImageEmbedder, AnimaNoiseInitializer,
                    AnimaShapeChecker)

# Every sampling default of the family (the reference's: 30 steps, cfg_scale 4 as nega + s * (posi - nega)).
CALL_DEFAULTS = {"height": 1024, "width": 1024, "num_inference_steps": 30, "cfg_scale": 4.0}


class AnimaPipeline(PromptImagePipeline):
    model_fn_inputs = ("prompt_embeds", "t5_ids", "t5_mask")
    padding_masks = ("t5_mask",)
    call_defaults = CALL_DEFAULTS
    target = Target((ImageStream(channels=LATENT_CHANNELS, scale=VAE_SCALE, patch=2,
                                 division=DIVISION_FACTOR, decoder=vae_decode),))
    scheduler_config = SCHEDULER_CONFIG  # the reference's "Z-Image" template: a static shift of 3
    base_units = (AnimaShapeChecker, AnimaNoiseInitializer, AnimaInputImageEmbedder, AnimaPromptEmbedder)

    @classmethod
    def check_models(cls, models) -> None:
        """The LLM adapter cross-attends to Qwen3's hidden states, source_dim wide."""
        dit, encoder = models.get("dit"), models.get("text_encoder")
        if dit is None or encoder is None:
            return
        width, wanted = encoder.config["hidden_size"], dit.config["conditioner_config"]["source_dim"]
        if width != wanted:
            raise UserError(f"the text_encoder {encoder.describe()} is {width} wide and the dit {dit.describe()}'s "
                            f"LLM adapter reads {wanted}-wide hidden states (source_dim): give the Anima DiT its own "
                            f"text encoder (Qwen3-0.6B)")

    def model_fn(self, latents, timestep, prompt_embeds, t5_ids=None, t5_mask=None, **inputs):
        if self.dit is None:
            raise UserError("no Anima DiT loaded")
        if t5_ids is None:
            raise UserError("the Anima DiT needs the prompt's T5 token ids (t5_ids): encode the prompt with the "
                            "pipeline's T5 tokenizer (--tokenizer_t5xxl_path)")
        return model_fn_anima(self.dit, latents, timestep, prompt_embeds, t5_ids, t5_mask, **inputs)

    def set_timesteps(self, values, num_inference_steps: int, denoising_strength: float = 1.0) -> None:
        """The static shift of 3 over linspace(1, 0, N + 1)[:-1] (the reference's Z-Image template);
        image-to-image runs the reference's schedule (all steps from sigma = strength)."""
        self.scheduler.set_timesteps(num_inference_steps, denoising_strength=denoising_strength,
                                     strength_mode="diffsynth" if denoising_strength < 1 else "diffusers")


__all__ = ["CALL_DEFAULTS", "AnimaPipeline"]
