"""`Ideogram4Pipeline`: Ideogram-4 text-to-image (and image-to-image), inference and the training hooks.

Guidance is Ideogram's asymmetric one: the negative side is no prompt at all, run through the unconditional DiT
(`dit_uncond`, the release's `unconditional_transformer/`) when it is loaded, else through the DiT with no text (the
reference's fallback); a negative prompt is accepted as the reference's and has nothing to change. `cfg_scale` s
blends the two as v = s * v_cond + (1 - s) * v_uncond (the reference's, and diffusers' `guidance_scale`). The row,
the call and the stage-1 batches are the base pipeline's, from its target (images; every row has one).
"""

from __future__ import annotations

from ...core.batch import SAME
from ...core.pipeline import PromptImagePipeline
from ...core.target import ImageStream, Target
from .model_fn import model_fn_ideogram4
from .scheduler import Ideogram4Scheduler
from ...errors import UserError
from .units import ACTIVATION_LAYERS, DIVISION_FACTOR, TOKEN_CHANNELS, Ideogram4InputImageEmbedder, Ideogram4NoiseInitializer, \
    Ideogram4PromptEmbedder, Ideogram4ShapeChecker, vae_decode

# Every sampling default of the family (the reference's: 50 steps at 1024 x 1024, cfg 7).
CALL_DEFAULTS = {"height": 1024, "width": 1024, "num_inference_steps": 50, "cfg_scale": 7.0}


class Ideogram4Pipeline(PromptImagePipeline):
    model_names = ("dit", "dit_uncond", "text_encoder", "vae")
    data_inputs = ("image", "prompt", "seed", "rand_device", "height", "width")
    input_batching = {"height": SAME, "width": SAME, "rand_device": SAME}
    call_defaults = CALL_DEFAULTS
    target = Target((ImageStream(channels=TOKEN_CHANNELS, scale=DIVISION_FACTOR, patch=1,
                                 division=DIVISION_FACTOR, decoder=vae_decode, required=True),))
    base_units = (Ideogram4ShapeChecker, Ideogram4PromptEmbedder, Ideogram4NoiseInitializer,
                  Ideogram4InputImageEmbedder)

    @classmethod
    def default_scheduler(cls):
        return Ideogram4Scheduler()

    @classmethod
    def check_models(cls, models) -> None:
        """Each DiT reads the text encoder's hidden states 0, 3, ..., 35 side by side: 13 x its width is the DiT's
        llm_features_dim."""
        encoder = models.get("text_encoder")
        if encoder is None:
            return
        text = encoder.config.get("text_config", encoder.config)
        width, depth = text["hidden_size"], text["num_hidden_layers"]
        if depth < max(ACTIVATION_LAYERS):  # hidden_states[0] is the embedding output
            raise UserError(f"the text_encoder {encoder.describe()} has {depth} layers and the DiT reads its hidden "
                            f"states {', '.join(map(str, ACTIVATION_LAYERS))}: give Ideogram-4 its own text "
                            f"encoder (Qwen3-VL-8B)")
        for slot in ("dit", "dit_uncond"):
            dit = models.get(slot)
            if dit is None:
                continue
            features = dit.config["llm_features_dim"]
            if features != width * len(ACTIVATION_LAYERS):
                raise UserError(f"the text_encoder {encoder.describe()} is {width} wide: its {len(ACTIVATION_LAYERS)} "
                                f"hidden states side by side are {width * len(ACTIVATION_LAYERS)} wide, and the "
                                f"{slot} {dit.describe()} reads {features} (llm_features_dim): give Ideogram-4 its "
                                f"own text encoder (Qwen3-VL-8B)")

    def model_fn(self, latents, timestep, prompt_embeds=None, prompt_embeds_mask=None, **inputs):
        return model_fn_ideogram4(self.dit, latents, timestep, prompt_embeds, prompt_embeds_mask,
                                  dit_uncond=self.models.get("dit_uncond"), pipe=self, features=self.features,
                                  **inputs)

    def load_lora(self, module, path: str, alpha: float = 1.0) -> None:
        """As the base; a DiT LoRA also fuses into the unconditional DiT (the reference's validate_lora loads the
        trained file into both: `pipe.load_lora(pipe.dit_uncond, path)`)."""
        uncond = self.models.get("dit_uncond")
        if uncond is None or module is not uncond:
            return super().load_lora(module, path, alpha)
        from ...lora import fuse_lora, load_lora_file

        lora = load_lora_file(path, converters=self.spec.lora_converters)
        prefix = self.spec.lora_prefix("dit_uncond")
        fuse_lora(module, lora, scale=alpha, component=prefix if prefix in lora.components
                  else self.spec.lora_prefix("dit"))

    def set_timesteps(self, values, num_inference_steps: int, denoising_strength: float = 1.0) -> None:
        """The logit-normal schedule for the image's size (height x width in pixels)."""
        self.scheduler.set_timesteps(num_inference_steps, denoising_strength=denoising_strength,
                                     image_seq_len=self.image_seq_len(values))


__all__ = ["CALL_DEFAULTS", "Ideogram4Pipeline"]
