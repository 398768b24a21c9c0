"""`FluxBasePipeline`: FLUX.1 text-to-image and image-to-image with no feature; `FluxImagePipeline`: the same with
every FLUX.1 variant the reference trains as a feature (Kontext, ControlNets, Fill, Redux, IP-Adapter, InfiniteYou,
EliGen, FLEX.2, AttriCtrl, LoRA-Encoder, Nexus-Gen, Insert-Anything), each in its own module and listed here;
Step1X-Edit, whose prompt comes from a connector at every step, is its own class on the base (step1x.py).

Architectures come from diffusers (`FluxTransformer2DModel`, `FluxControlNetModel`, `ReduxImageEncoder`,
`AutoencoderKL`) and transformers (`CLIPTextModel`, `T5EncoderModel`, `SiglipVisionModel`), so released checkpoints
load with their own key names. docs/flux.md lists the variants with their weights, data columns and flags.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from PIL import Image

from ...core.batch import SAME
from ...core.features import IMAGE, IMAGES, RunContext
from ...core.pipeline import BasePipeline
from ...core.target import ImageStream, Target
from ...errors import UserError
from ...media.image import as_image_list
from ...parts.flux_ae import vae_decode
from .components import SCHEDULER_CONFIG, TRAINING_MU
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
    text-to-image and image-to-image. It lists no feature: FluxImagePipeline adds them."""

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

    def __init_subclass__(cls, **kwargs):
        """A pipeline class also gets the run-time settings its features' units read."""
        super().__init_subclass__(**kwargs)
        cls.settings = frozenset({*cls.settings, *(s for f in cls.features for s in getattr(f, "unit_settings", ()))})

    def __init__(self, device="cpu", torch_dtype=torch.float32, scheduler=None):
        super().__init__(device, torch_dtype)
        self.scheduler = scheduler or self.default_scheduler()
        self.tokenizer_1 = None
        self.tokenizer_2 = None
        for feature in self.features:
            for name, default in getattr(feature, "attributes", {}).items():
                setattr(self, name, default)
        self.units = [FluxShapeChecker(), FluxNoiseInitializer(), FluxInputImageEmbedder(), FluxClipEmbedder(),
                      FluxT5Embedder(), FluxEmbeddedGuidance()]

    @staticmethod
    def default_scheduler():
        """FLUX.1-dev's scheduler config (mu from the image size, as FluxPipeline); training at the reference's
        static shift 3 (mu = ln 3)."""
        from ...schedulers import FlowMatchScheduler

        return FlowMatchScheduler(training_mu=TRAINING_MU, **SCHEDULER_CONFIG)

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

    # -- training -------------------------------------------------------------------------------------
    def training_inputs(self, data: dict[str, Any]) -> dict[str, Any]:
        """An image and its prompt, and the features' columns by kind (`feature_data`; every column of a feature
        present, None where the row has none), checked by each feature (`training_values`)."""
        row = data.get("_row")
        where = f"row {row + 1}" if isinstance(row, int) else "row ?"
        image = data.get("image")
        if image is not None and not isinstance(image, Image.Image):
            raise UserError(f"{where}: 'image' must be an image file listed in --data_file_keys")
        prompt = data.get("prompt", "")
        if prompt is None or (isinstance(prompt, float) and math.isnan(prompt)):
            prompt = ""
        values = {
            "prompt": prompt, "negative_prompt": "", "input_image": image,
            "height": image.size[1] if image is not None else data.get("height"),
            "width": image.size[0] if image is not None else data.get("width"),
            "seed": data.get("seed"), "batch_size": 1, "embedded_guidance": TRAINING_GUIDANCE,
            "num_inference_steps": data.get("num_inference_steps"),
            **dict.fromkeys(self.input_kinds()), **self.feature_data(data),
        }
        for feature in self.features:
            feature.training_values(values, where)
        return values

    @classmethod
    def batch_signature(cls, sample: dict[str, Any]) -> tuple:
        def size(v):
            return v.size if isinstance(v, Image.Image) else tuple(map(size, v)) if isinstance(v, list) else None

        images = [name for name, kind in cls.input_kinds().items() if kind in (IMAGE, IMAGES)]
        return (size(sample.get("image")), *(size(sample.get(c)) for c in images))

    # -- inference ------------------------------------------------------------------------------------
    def __call__(self, prompt: str | list[str], negative_prompt: str | list[str] = "",
                 cfg_scale: float = CALL_DEFAULTS["cfg_scale"],
                 embedded_guidance: float = CALL_DEFAULTS["embedded_guidance"],
                 height: int | None = CALL_DEFAULTS["height"], width: int | None = CALL_DEFAULTS["width"],
                 num_inference_steps: int = CALL_DEFAULTS["num_inference_steps"], seed: int | None = None,
                 input_image=None, denoising_strength: float = 1.0, progress: bool = True, output_type: str = "pil",
                 **inputs):
        """Images as PIL images (one per prompt; one image for one prompt). `inputs`: the features' inputs by the
        reference's names (`call_inputs()` lists them; docs/flux.md has each feature's, and each feature's module
        says what it takes)."""
        given, settings = self.take_call_inputs(inputs)
        values = self.prompt_values(prompt, negative_prompt)
        n = values["batch_size"]
        values.update({"height": height, "width": width, **given})
        state: dict[str, Any] = {}
        for feature in self.features:
            feature.prepare_call(self, values, cfg_scale, state)
        if input_image is not None and (values["height"] is None or values["width"] is None):
            values["width"], values["height"] = as_image_list(input_image)[0].size
        values.update({"seed": seed, "input_image": input_image, "embedded_guidance": embedded_guidance})
        out = self.generate(values, cfg_scale=cfg_scale, num_inference_steps=num_inference_steps,
                            denoising_strength=denoising_strength, settings=settings, progress=progress,
                            output_type=output_type)
        for feature in self.features:
            out = feature.finish_images(out, output_type, state)
        return out[0] if isinstance(prompt, str) and output_type == "pil" and n == 1 else out


class FluxImagePipeline(FluxBasePipeline):
    """FLUX.1 with the features that add to the same algorithm (each its own module, chosen per run from its data
    columns and models; docs/flux.md). Their order places their units among the base units and orders their parts
    of the denoiser call."""

    features = (KONTEXT, CONTROLNET_FEATURE, FILL, FLEX, IPADAPTER_FEATURE, REDUX, INFINITEYOU, ELIGEN, VALUE_CONTROL,
                LORA_ENCODER_FEATURE, NEXUS_GEN, INSERT_ANYTHING)


__all__ = ["CALL_DEFAULTS", "FluxBasePipeline", "FluxImagePipeline"]
