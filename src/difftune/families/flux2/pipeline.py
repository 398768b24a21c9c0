"""`Flux2Pipeline`: FLUX.2-dev (Mistral-3 text encoder, embedded guidance) and FLUX.2-klein 4B / 9B and their base
models (Qwen3 text encoder, no guidance embedder): text-to-image and image-to-image, inference and the training
hooks. Which text encoder and whether the DiT embeds guidance follow from the loaded models, so one class serves all.
The row, the call and the stage-1 batches are the base pipeline's, from its target (images) and its feature (edit
images beside the target).
"""

from __future__ import annotations

from ...core.options import sample_input
from ...core.pipeline import PromptImagePipeline
from ...core.target import ImageStream, Target
from ...errors import UserError
from .components import SCHEDULER_CONFIG, TEXT_ENCODER_MISTRAL, TEXT_ENCODER_QWEN3, TRAINING_MU
from .edit import EDIT
from .latents import LATENT_CHANNELS, VAE_SCALE, vae_decode
from .model_fn import model_fn_flux2
from .prompt import MISTRAL3_LAYERS, QWEN3_LAYERS, Flux2PromptEmbedder
from .units import (DIVISION_FACTOR, Flux2EmbeddedGuidance, Flux2InputImageEmbedder, Flux2NoiseInitializer,
                    Flux2ShapeChecker)

TRAINING_GUIDANCE = 1.0  # the reference's embedded_guidance in training
# Every sampling default (the reference's: 30 steps, no CFG, an embedded guidance of 4 that klein ignores).
CALL_DEFAULTS = {"height": 1024, "width": 1024, "num_inference_steps": 30, "cfg_scale": 1.0,
                 "embedded_guidance": 4.0}


def compute_empirical_mu(image_seq_len: int, num_steps: int) -> float:
    """The time shift FLUX.2 samples at (diffusers' `compute_empirical_mu`, BFL's fit over image size and steps)."""
    from diffusers.pipelines.flux2.pipeline_flux2 import compute_empirical_mu as mu

    return mu(image_seq_len=image_seq_len, num_steps=num_steps)


class Flux2Pipeline(PromptImagePipeline):
    settings = frozenset({"batch_size", "rand_device", "use_gradient_checkpointing",
                          "use_gradient_checkpointing_offload", "edit_image_auto_resize"})
    model_fn_inputs = ("prompt_embeds", "guidance")
    padding_masks = ()
    features = (EDIT,)  # edit.py: reference images beside the target
    sampling_values = ("guidance",)  # embedded guidance: the sampling default, not the training value
    batch_shared_inputs = ("height", "width", "rand_device", "embedded_guidance")
    call_defaults = CALL_DEFAULTS
    # `cfg_scale` is the reference's (nega + s * (posi - nega)), which is diffusers' `guidance_scale` of the klein
    # base models; `embedded_guidance` is Flux2Pipeline's `guidance_scale` (dev's distilled guidance), 1 in training.
    call_parameters = {"embedded_guidance": CALL_DEFAULTS["embedded_guidance"]}
    sample_flags = {"embedded_guidance": sample_input("FLUX.2-dev's distilled guidance (default: the family's, 4; "
                                                      "klein has none).", kind=float)}
    training_values = {"embedded_guidance": TRAINING_GUIDANCE}
    target = Target((ImageStream(channels=LATENT_CHANNELS, scale=VAE_SCALE, patch=1,
                                 division=DIVISION_FACTOR, decoder=vae_decode),))
    scheduler_config, training_mu = SCHEDULER_CONFIG, TRAINING_MU  # training at the reference's fixed mu of 0.8
    base_units = (Flux2ShapeChecker, Flux2NoiseInitializer, Flux2InputImageEmbedder, Flux2PromptEmbedder,
                  Flux2EmbeddedGuidance)

    @classmethod
    def check_models(cls, models) -> None:
        """dev's DiT (a guidance embedder) reads Mistral-3's layers 10, 20, 30, klein's (none) Qwen3's 9, 18, 27,
        stacked: 3 x the encoder's width is the DiT's joint_attention_dim."""
        dit, encoder = models.get("dit"), models.get("text_encoder")
        if dit is None or encoder is None:
            return
        dev = bool(dit.config.get("guidance_embeds"))
        wanted = TEXT_ENCODER_MISTRAL if dev else TEXT_ENCODER_QWEN3
        release = "FLUX.2-dev's (it has a guidance embedder)" if dev else "a FLUX.2-klein's (no guidance embedder)"
        if encoder.spec is not wanted:
            raise UserError(f"the text_encoder {encoder.describe()} is a {encoder.spec.class_name} and the dit "
                            f"{dit.describe()} is {release}, which reads a {wanted.class_name}: give the text "
                            f"encoder of the DiT's release")
        width, layers = encoder.config["hidden_size"], MISTRAL3_LAYERS if dev else QWEN3_LAYERS
        joint = dit.config["joint_attention_dim"]
        if 3 * width != joint:
            raise UserError(f"the text_encoder {encoder.describe()} is {width} wide: its 3 stacked hidden states are "
                            f"{3 * width} wide, and the dit {dit.describe()} reads {joint} (joint_attention_dim, a "
                            f"{joint // 3}-wide encoder): give the text encoder of the DiT's size")
        depth = encoder.config["num_hidden_layers"]
        if depth < max(layers):
            raise UserError(f"the text_encoder {encoder.describe()} has {depth} layers and the dit reads its hidden "
                            f"states {', '.join(map(str, layers))}: give the text encoder of the DiT's release")

    # -- model_fn -------------------------------------------------------------------------------------
    def model_fn(self, latents, timestep, prompt_embeds, guidance=None, **inputs):
        if self.dit is None:
            raise UserError("no FLUX.2 DiT loaded")
        return model_fn_flux2(self.dit, latents, timestep, prompt_embeds, guidance, pipe=self,
                              features=self.features, **inputs)

    def set_timesteps(self, values, num_inference_steps: int, denoising_strength: float = 1.0) -> None:
        """mu from the image's token count and the number of steps (diffusers' Flux2 pipelines, the reference)."""
        mu = compute_empirical_mu(self.image_seq_len(values), int(num_inference_steps))
        self.scheduler.set_timesteps(num_inference_steps, denoising_strength=denoising_strength, mu=mu)


__all__ = ["CALL_DEFAULTS", "Flux2Pipeline", "compute_empirical_mu"]
