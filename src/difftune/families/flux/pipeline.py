"""`FluxBasePipeline`: FLUX.1 text-to-image and image-to-image with no feature; `FluxImagePipeline`: the same with
every FLUX.1 variant the reference trains as a feature (Kontext, ControlNets, Fill, Redux, IP-Adapter, InfiniteYou,
EliGen, FLEX.2, AttriCtrl, LoRA-Encoder, Nexus-Gen, Insert-Anything), each in its own module and listed here;
Step1X-Edit, whose prompt comes from a connector at every step, is its own class on the base (step1x.py).

Architectures come from diffusers (`FluxTransformer2DModel`, `FluxControlNetModel`, `ReduxImageEncoder`,
`AutoencoderKL`) and transformers (`CLIPTextModel`, `T5EncoderModel`, `SiglipVisionModel`), so released checkpoints
load with their own key names. docs/flux.md lists the variants with their weights, data columns and flags.
"""

from __future__ import annotations

from ...core.batch import SAME
from ...core.features import RunContext
from ...core.options import sample_input
from ...core.pipeline import BasePipeline
from ...core.target import ImageStream, Target
from ...errors import UserError
from ...parts.flux_ae import vae_decode
from .components import SCHEDULER_CONFIG, TRAINING_MU, TRAINING_SIGMA_MIN
from .controlnet import CONTROLNET_FEATURE
from .eligen import ELIGEN
from .fill import FILL
from .flex2 import FLEX
from .infiniteyou import INFINITEYOU
from .insert_anything import INSERT_ANYTHING
from .ipadapter import IPADAPTER_FEATURE
from .kontext import KONTEXT
from .lora_encoder import LORA_ENCODER_FEATURE
from .model_fn import model_fn_flux
from .nexus_gen import NEXUS_GEN
from .redux import REDUX
from .units import (DIVISION_FACTOR, FluxClipEmbedder, FluxEmbeddedGuidance, FluxInputImageEmbedder,
                    FluxNoiseInitializer, FluxShapeChecker, FluxT5Embedder)
from .value_control import VALUE_CONTROL

TRAINING_GUIDANCE = 1.0  # the reference's embedded_guidance in training
# The family's sampling defaults (FluxPipeline's; FLUX.1-dev is guidance-distilled: cfg 1 and an embedded guidance
# of 3.5): one place, read by __call__, `difftune sample`, validation and model_fn.
CALL_DEFAULTS = {"height": 1024, "width": 1024, "num_inference_steps": 30, "cfg_scale": 1.0,
                 "embedded_guidance": 3.5}


class FluxBasePipeline(BasePipeline):
    """FLUX.1 (dev, schnell, Krea, ...): the prompt through CLIP (pooled) and T5 (tokens), the embedded guidance,
    text-to-image and image-to-image. It lists no feature: FluxImagePipeline adds them. The row, the call (the
    features' inputs by the reference's names: `call_inputs()`, docs/flux.md) and stage 1's batches are the base
    pipeline's."""

    model_names = ("dit", "text_encoder", "text_encoder_2", "vae")
    batch_shared_inputs = ("height", "width", "embedded_guidance")  # kept once in a stage-1 batch
    settings = frozenset({"batch_size", "use_gradient_checkpointing", "use_gradient_checkpointing_offload"})
    model_fn_inputs = ("prompt_embeds", "pooled_prompt_embeds", "guidance")
    sampling_values = ("guidance",)  # embedded guidance: the sampling default, not the training value
    data_inputs = ("image", "prompt", "seed", "num_inference_steps", "height", "width")
    input_batching = {"num_inference_steps": SAME, "height": SAME, "width": SAME}
    loss_models = ("dit",)
    call_defaults = CALL_DEFAULTS
    target = Target((ImageStream(channels=16, scale=8, patch=2, division=DIVISION_FACTOR, decoder=vae_decode),))

    every_feature_column = True  # a feature's file column no flag loads is refused, not ignored
    call_parameters = {"embedded_guidance": CALL_DEFAULTS["embedded_guidance"]}  # FluxPipeline's guidance_scale
    sample_flags = {"embedded_guidance": sample_input("FLUX.1-dev's distilled guidance (default: the family's, "
                                                      "3.5).", kind=float)}
    training_values = {"embedded_guidance": TRAINING_GUIDANCE}
    scheduler_config, training_mu = SCHEDULER_CONFIG, TRAINING_MU  # mu from the size; trained at the reference's ln 3
    training_sigma_min = TRAINING_SIGMA_MIN  # and on its table
    base_units = (FluxShapeChecker, FluxNoiseInitializer, FluxInputImageEmbedder, FluxClipEmbedder, FluxT5Embedder,
                  FluxEmbeddedGuidance)

    @classmethod
    def check_run(cls, context: RunContext, features: frozenset[str]) -> None:
        """A feature's model given without the data it reads would be loaded (and trained) for nothing (the features
        check their own parts in `check_features`)."""
        fed = {r for f in cls.features if f.name in features for r in f.requires}  # another feature gives the data
        for feature in cls.features:
            given = [m for m in feature.models if context.config(m) is not None]
            if feature.name in fed:
                continue
            if given and feature.columns and not context.has(*feature.columns):
                raise UserError(f"{given[0]} is given but the data has no {' or '.join(feature.columns)} column "
                                f"({feature.description}): name it in --extra_inputs (and --data_file_keys for "
                                f"images), or leave the model out")

    # -- model_fn -------------------------------------------------------------------------------------
    def model_fn(self, latents, timestep, prompt_embeds, pooled_prompt_embeds=None, guidance=None, **inputs):
        """One denoiser call; each feature whose inputs it has adds its part (model_fn.py)."""
        return model_fn_flux(self.dit, latents, timestep, prompt_embeds, pooled_prompt_embeds, guidance,
                             default_guidance=self.call_defaults["embedded_guidance"], pipe=self,
                             features=self.features, **inputs)

    def negative_name(self, name: str) -> str:
        """Values with a negative version written beside them by one unit (IP-Adapter's zero features, LoRA-Encoder's
        none) besides the prompt units' pairs."""
        if any(f"negative_{name}" in u.outputs for u in self.all_units):
            return f"negative_{name}"
        return super().negative_name(name)

class FluxImagePipeline(FluxBasePipeline):
    """FLUX.1 with the features that add to the same algorithm (each its own module, chosen per run from its data
    columns and models; docs/flux.md). Their order places their units among the base units and orders their parts
    of the denoiser call."""

    features = (KONTEXT, CONTROLNET_FEATURE, FILL, FLEX, IPADAPTER_FEATURE, REDUX, INFINITEYOU, ELIGEN, VALUE_CONTROL,
                LORA_ENCODER_FEATURE, NEXUS_GEN, INSERT_ANYTHING)


__all__ = ["CALL_DEFAULTS", "FluxBasePipeline", "FluxImagePipeline"]
