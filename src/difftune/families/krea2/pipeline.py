"""`Krea2Pipeline`: Krea-2 Raw and Turbo (text-to-image, image-to-image): inference and the training hooks.

One pipeline with no features: the reference's Krea-2 scripts feed an image and a prompt only. Raw samples with the
resolution-aware time shift (mu from the image's token count, as diffusers); Turbo, the few-step distilled
checkpoint, with a fixed mu of 1.15 (`mu=1.15`, 8 steps, cfg_scale 1, as the reference's Turbo example). The row,
the call and the stage-1 batches are the base pipeline's, from its target (images).
"""

from __future__ import annotations

from ...core.batch import SAME
from ...core.options import sample_input
from ...core.pipeline import PromptImagePipeline
from ...core.target import ImageStream, Target
from ...errors import UserError
from ...parts.qwen_image_vae import vae_decode
from .components import SCHEDULER_CONFIG, TEXT_LAYERS, TRAINING_MU
from .model_fn import model_fn_krea2
from .prompt import Krea2PromptEmbedder
from .units import (DIVISION_FACTOR, LATENT_CHANNELS, VAE_SCALE, Krea2InputImageEmbedder, Krea2NoiseInitializer,
                    Krea2ShapeChecker)

# Every sampling default of the family (the reference's Raw defaults; `cfg_scale` is the reference's
# nega + s * (posi - nega), so diffusers' guidance_scale g is s = 1 + g).
CALL_DEFAULTS = {"height": 1024, "width": 1024, "num_inference_steps": 52, "cfg_scale": 3.5}


class Krea2Pipeline(PromptImagePipeline):
    data_inputs = ("image", "prompt", "seed", "rand_device", "height", "width")
    input_batching = {"height": SAME, "width": SAME, "rand_device": SAME}
    call_defaults = CALL_DEFAULTS
    call_parameters = {"mu": None}  # a fixed time shift (Turbo: 1.15); None: from the image size (Raw)
    sample_flags = {"shift_mu": sample_input("A fixed time shift mu (Krea-2-Turbo: 1.15, with 8 steps and --cfg_scale "
                                             "1); default: from the image size (Raw).", kind=float, input="mu")}
    target = Target((ImageStream(channels=LATENT_CHANNELS, scale=VAE_SCALE, patch=2,
                                 division=DIVISION_FACTOR, decoder=vae_decode),))
    scheduler_config, training_mu = SCHEDULER_CONFIG, TRAINING_MU  # dynamic shift, trained at the reference's 0.8
    base_units = (Krea2ShapeChecker, Krea2NoiseInitializer, Krea2InputImageEmbedder, Krea2PromptEmbedder)

    @classmethod
    def check_models(cls, models) -> None:
        """The DiT fuses the text encoder's hidden states 2, 5, ..., 35 of its width (text_hidden_dim)."""
        dit, encoder = models.get("dit"), models.get("text_encoder")
        if dit is None or encoder is None:
            return
        text = encoder.config.get("text_config", encoder.config)
        width, depth = text["hidden_size"], text["num_hidden_layers"]
        if width != dit.config["text_hidden_dim"]:
            raise UserError(f"the text_encoder {encoder.describe()} is {width} wide and the dit {dit.describe()} "
                            f"reads {dit.config['text_hidden_dim']}-wide hidden states (text_hidden_dim): give the "
                            f"Krea-2 DiT its own text encoder (Qwen3-VL-4B)")
        if depth < TEXT_LAYERS[-1]:  # hidden_states[0] is the embedding output
            raise UserError(f"the text_encoder {encoder.describe()} has {depth} layers and the dit reads its hidden "
                            f"states {', '.join(map(str, TEXT_LAYERS))}: give the Krea-2 DiT its own text encoder")

    def model_fn(self, latents, timestep, prompt_embeds, prompt_embeds_mask=None, **inputs):
        if self.dit is None:
            raise UserError("no Krea-2 DiT loaded")
        return model_fn_krea2(self.dit, latents, timestep, prompt_embeds, prompt_embeds_mask, pipe=self,
                              features=self.features, **inputs)

    def set_timesteps(self, values, num_inference_steps: int, denoising_strength: float = 1.0) -> None:
        """mu from the image's token count (Raw), or the call's `mu` (Turbo: 1.15); image-to-image runs the
        reference's schedule (all steps from sigma = strength)."""
        self.scheduler.set_timesteps(num_inference_steps, denoising_strength=denoising_strength,
                                     image_seq_len=self.image_seq_len(values), mu=values.get("mu"),
                                     strength_mode="diffsynth" if denoising_strength < 1 else "diffusers")


__all__ = ["CALL_DEFAULTS", "Krea2Pipeline"]
