"""`FluxImagePipeline`: FLUX.1 text-to-image and image-to-image, and every FLUX.1 variant the reference trains as a
feature of one pipeline (Kontext, ControlNets, Fill, Redux, IP-Adapter, InfiniteYou, EliGen, FLEX.2, AttriCtrl,
LoRA-Encoder, Nexus-Gen, Insert-Anything); Step1X-Edit, whose prompt comes from a connector at every step, is its own
class (step1x.py).

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
from ...core.features import Feature, RunContext
from ...core.pipeline import BasePipeline
from ...errors import UserError
from ...util import text_list
from ...media.image import as_image_list
from ...parts.flux_ae import vae_decode
from .components import SCHEDULER_CONFIG, TRAINING_MU
from .controlnet import FluxControlNetEmbedder, controlnet_call_inputs
from .eligen import FluxEntityControl
from .fill import FluxFillCondition
from .flex2 import FluxFlexConditioner
from .infiniteyou import FluxInfiniteYouEmbedder
from .insert_anything import FluxInsertAnything, paste_back, prepare
from .ipadapter import FluxIPAdapterImageEncoder
from .lora_encoder import FluxLoRAEncoderEmbedder, FluxLoRAEncoderInputs
from .model_fn import model_fn_flux
from .nexus_gen import NexusGenEmbedder
from .redux import FluxReduxPromptEmbedder
from .units import (DIVISION_FACTOR, FluxClipEmbedder, FluxEmbeddedGuidance, FluxInputImageEmbedder,
                    FluxKontextEmbedder, FluxNoiseInitializer, FluxShapeChecker, FluxT5Embedder)
from .value_control import FluxValueControlEmbedder

TRAINING_GUIDANCE = 1.0  # the reference's embedded_guidance in training
# The family's sampling defaults (FluxPipeline's; FLUX.1-dev is guidance-distilled: cfg 1 and an embedded guidance
# of 3.5): one place, read by __call__, `difftune sample`, validation and model_fn.
CALL_DEFAULTS = {"height": 1024, "width": 1024, "num_inference_steps": 30, "cfg_scale": 1.0,
                 "embedded_guidance": 3.5}

# Data columns that hold images (files named in --data_file_keys, loaded as PIL images).
IMAGE_COLUMNS = ("kontext_images", "controlnet_image", "controlnet_inpaint_mask", "flux_fill_image", "flux_fill_mask",
                 "flux_redux_image", "ipadapter_images", "infinityou_id_image", "eligen_entity_masks",
                 "flex_inpaint_image", "flex_inpaint_mask", "flex_control_image", "nexus_gen_reference_image",
                 "insert_anything_source_image", "insert_anything_source_mask", "insert_anything_ref_image",
                 "insert_anything_ref_mask")
# Image columns that hold several images per sample: a sample's value is always a list (so that a stage-1 batch is a
# list per sample).
LIST_COLUMNS = ("kontext_images", "ipadapter_images", "eligen_entity_masks")
# Other data columns the features read (numbers, text, paths).
VALUE_COLUMNS = ("controlnet_processor_id", "infinityou_face_embedding", "infinityou_guidance", "eligen_entity_prompts",
                 "flex_control_strength", "flex_control_stop", "value_controller_inputs", "lora_encoder_inputs",
                 "lora_encoder_scale")

KONTEXT = Feature("kontext", columns=("kontext_images",), model_fn_inputs=("kontext_latents", "kontext_ids"),
                  description="FLUX.1 Kontext: reference images' tokens beside the image's")
CONTROLNET = Feature("controlnet", columns=("controlnet_image",), models=("controlnet",),
                     model_fn_inputs=("controlnet_conditioning", "controlnet_mode", "controlnet_scale"),
                     data_inputs=("controlnet_image", "controlnet_inpaint_mask", "controlnet_processor_id"),
                     description="a ControlNet (Union-alpha, Upscaler, Inpainting-Beta, InfiniteYou's InfuseNet)")
FILL = Feature("fill", columns=("flux_fill_image", "flux_fill_mask"), model_fn_inputs=("fill_condition",),
               description="FLUX.1 Fill: a masked image and its mask as condition channels")
REDUX = Feature("redux", columns=("flux_redux_image",), models=("flux_redux_image_encoder", "flux_redux_image_embedder"),
                description="FLUX.1 Redux: an image's SigLIP tokens in place of the prompt")
IPADAPTER = Feature("ipadapter", columns=("ipadapter_images",), models=("ipadapter",),
                    model_fn_inputs=("ipadapter_image_embeds", "ipadapter_scale"),
                    description="InstantX's IP-Adapter: SigLIP features attended in every block")
INFINITEYOU = Feature("infiniteyou", columns=("infinityou_id_image", "infinityou_face_embedding"),
                      models=("image_proj_model",), requires=("controlnet",),
                      model_fn_inputs=("infinityou_face_embeds", "infinityou_guidance"),
                      data_inputs=("infinityou_id_image", "infinityou_face_embedding", "infinityou_guidance"),
                      description="InfiniteYou: a face embedding's tokens as the InfuseNet ControlNet's prompt")
ELIGEN = Feature("eligen", columns=("eligen_entity_prompts", "eligen_entity_masks"),
                 model_fn_inputs=("entity_prompt_embeds", "entity_masks"),
                 description="EliGen: entity prompts with regional attention masks")
FLEX = Feature("flex", columns=("flex_inpaint_image", "flex_inpaint_mask", "flex_control_image"),
               model_fn_inputs=("flex_condition", "flex_uncondition", "flex_control_stop"),
               data_inputs=("flex_inpaint_image", "flex_inpaint_mask", "flex_control_image", "flex_control_strength",
                            "flex_control_stop"),
               description="FLEX.2: inpaint and control images as condition channels")
VALUE_CONTROL = Feature("value_control", columns=("value_controller_inputs",), models=("value_controller",),
                        model_fn_inputs=("value_embeds",), description="AttriCtrl: a value's tokens after the prompt")
LORA_ENCODER = Feature("lora_encoder", columns=("lora_encoder_inputs",), models=("lora_encoder",),
                       model_fn_inputs=("lora_encoder_embeds",), data_inputs=("lora_encoder_inputs",
                                                                             "lora_encoder_scale"),
                       description="LoRA-Encoder: a LoRA file's tokens after the prompt")
NEXUS_GEN = Feature("nexus_gen", columns=("nexus_gen_reference_image",), models=("nexus_gen",),
                    model_fn_inputs=("txt_ids",),
                    description="Nexus-Gen editing: Qwen2.5-VL's predicted image embeddings as the prompt")
INSERT_ANYTHING = Feature("insert_anything", columns=("insert_anything_source_image",), requires=("fill", "redux"),
                          data_inputs=("insert_anything_source_image", "insert_anything_source_mask",
                                       "insert_anything_ref_image", "insert_anything_ref_mask"),
                          description="Insert-Anything: a reference object inserted by Fill + Redux on a diptych")


class FluxImagePipeline(BasePipeline):
    model_names = ("dit", "text_encoder", "text_encoder_2", "vae", "controlnet", "ipadapter", "ipadapter_image_encoder",
                   "flux_redux_image_encoder", "flux_redux_image_embedder", "image_proj_model", "value_controller",
                   "lora_encoder", "nexus_gen", "nexus_gen_editing_adapter")
    batch_shared_inputs = ("height", "width", "embedded_guidance")  # kept once in a stage-1 batch
    settings = frozenset({"batch_size", "use_gradient_checkpointing", "use_gradient_checkpointing_offload",
                          "insert_anything_size"})
    model_fn_inputs = ("prompt_embeds", "pooled_prompt_embeds", "guidance")
    sampling_values = ("guidance",)  # embedded guidance: the sampling default, not the training value
    features = (KONTEXT, CONTROLNET, FILL, REDUX, IPADAPTER, INFINITEYOU, ELIGEN, FLEX, VALUE_CONTROL, LORA_ENCODER,
                NEXUS_GEN, INSERT_ANYTHING)
    data_inputs = ("image", "prompt", "seed", "num_inference_steps", "height", "width")
    input_batching = {"num_inference_steps": SAME, "height": SAME, "width": SAME}
    # model_fn runs the ControlNet, the IP-Adapter and InfiniteYou's projector (where loaded): stage 2 loads them
    loss_models = ("dit", "controlnet", "ipadapter", "image_proj_model")
    decode_models = ("vae",)
    division_factor = DIVISION_FACTOR
    call_defaults = CALL_DEFAULTS

    patch_size = 2
    vae_scale = 8
    latent_channels = 16

    def __init__(self, device="cpu", torch_dtype=torch.float32, scheduler=None):
        super().__init__(device, torch_dtype)
        self.scheduler = scheduler or self.default_scheduler()
        self.tokenizer_1 = None
        self.tokenizer_2 = None
        self.nexus_gen_processor = None
        self.face_embedder = None  # InfiniteYou: an image -> its face's ArcFace embedding (InsightFace by default)
        self.units = [FluxInsertAnything(), FluxShapeChecker(), FluxNoiseInitializer(), FluxInputImageEmbedder(),
                      FluxKontextEmbedder(), FluxControlNetEmbedder(), FluxFillCondition(), FluxFlexConditioner(),
                      FluxIPAdapterImageEncoder(), FluxInfiniteYouEmbedder(), FluxClipEmbedder(), FluxT5Embedder(),
                      FluxReduxPromptEmbedder(), NexusGenEmbedder(), FluxEntityControl(), FluxValueControlEmbedder(),
                      FluxLoRAEncoderInputs(), FluxLoRAEncoderEmbedder(), FluxEmbeddedGuidance()]

    @staticmethod
    def default_scheduler():
        """FLUX.1-dev's scheduler config (mu from the image size, as FluxPipeline); training at the reference's
        static shift 3 (mu = ln 3)."""
        from ...schedulers import FlowMatchScheduler

        return FlowMatchScheduler(training_mu=TRAINING_MU, **SCHEDULER_CONFIG)

    @classmethod
    def check_run(cls, context: RunContext, features: frozenset[str]) -> None:
        """A variant's model given without the data it reads would be loaded (and trained) for nothing."""
        fed = {r for f in cls.features if f.name in features for r in f.requires}  # another feature gives the data
        for feature in cls.features:
            given = [m for m in feature.models if context.config(m) is not None]
            if feature.name in fed:
                continue
            if given and feature.columns and not context.has(*feature.columns):
                raise UserError(f"{given[0]} is given but the data has no {' or '.join(feature.columns)} column "
                                f"({feature.description}): name it in --extra_inputs (and --data_file_keys for "
                                f"images), or leave the model out")
        if "infiniteyou" in features and not context.has("controlnet_image"):
            raise UserError("InfiniteYou needs a controlnet_image column (the InfuseNet ControlNet's control image)")

    # -- model_fn -------------------------------------------------------------------------------------
    def model_fn(self, latents, timestep, prompt_embeds, pooled_prompt_embeds=None, guidance=None,
                 kontext_latents=None, kontext_ids=None, flex_control_stop=None, **settings):
        return model_fn_flux(self.dit, latents, timestep, prompt_embeds, pooled_prompt_embeds, guidance,
                             kontext_latents, kontext_ids, default_guidance=self.call_defaults["embedded_guidance"],
                             controlnet=self.models.get("controlnet"), ipadapter=self.models.get("ipadapter"),
                             image_proj_model=self.models.get("image_proj_model"),
                             flex_stop_t=self.flex_stop_timestep(flex_control_stop), **settings)

    def flex_stop_timestep(self, stop) -> float | None:
        """FLEX.2's control stops at the timestep `stop` of the way through the schedule (the reference's
        timesteps[int(stop * (n - 1))]; the training table's in training); None: never."""
        from .flex2 import flex_stop_timestep

        if stop is None or float(stop) >= 1.0:
            return None
        scheduler = self.scheduler
        timesteps = scheduler.training_table(scheduler.training_mu())[1] if scheduler.training else \
            scheduler.timesteps
        return flex_stop_timestep(timesteps, float(stop))

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return vae_decode(self, latents)

    def negative_name(self, name: str) -> str:
        """Values with a negative version written beside them by one unit (IP-Adapter's zero features, LoRA-Encoder's
        none) besides the prompt units' pairs."""
        if any(f"negative_{name}" in u.outputs for u in self.all_units):
            return f"negative_{name}"
        return super().negative_name(name)

    # -- training -------------------------------------------------------------------------------------
    def training_inputs(self, data: dict[str, Any]) -> dict[str, Any]:
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
        }
        for column in IMAGE_COLUMNS:
            values[column] = _images(data.get(column), column, where)
            if column in LIST_COLUMNS and isinstance(values[column], Image.Image):
                values[column] = [values[column]]
        for column in VALUE_COLUMNS:
            values[column] = data.get(column)
        values["eligen_entity_prompts"] = text_list(values["eligen_entity_prompts"], "eligen_entity_prompts", where)
        if (values["eligen_entity_prompts"] is None) != (values["eligen_entity_masks"] is None):
            raise UserError(f"{where}: EliGen needs eligen_entity_prompts and eligen_entity_masks (one prompt per mask "
                            f"image), one of them is missing")
        return values

    @staticmethod
    def batch_signature(sample: dict[str, Any]) -> tuple:
        def size(v):
            return v.size if isinstance(v, Image.Image) else tuple(map(size, v)) if isinstance(v, list) else None

        return (size(sample.get("image")), *(size(sample.get(c)) for c in IMAGE_COLUMNS))

    # -- inference ------------------------------------------------------------------------------------
    def __call__(self, prompt: str | list[str], negative_prompt: str | list[str] = "",
                 cfg_scale: float = CALL_DEFAULTS["cfg_scale"],
                 embedded_guidance: float = CALL_DEFAULTS["embedded_guidance"],
                 height: int | None = CALL_DEFAULTS["height"], width: int | None = CALL_DEFAULTS["width"],
                 num_inference_steps: int = CALL_DEFAULTS["num_inference_steps"], seed: int | None = None,
                 input_image=None, denoising_strength: float = 1.0, kontext_images=None,
                 controlnet_image=None, controlnet_inpaint_mask=None, controlnet_processor_id=None,
                 controlnet_scale: float | None = None, controlnet_inputs=None,
                 flux_fill_image=None, flux_fill_mask=None, flux_redux_image=None,
                 ipadapter_images=None, ipadapter_scale: float | None = None,
                 infinityou_id_image=None, infinityou_face_embedding=None, infinityou_guidance: float = 1.0,
                 eligen_entity_prompts=None, eligen_entity_masks=None, eligen_enable_on_negative: bool = False,
                 flex_inpaint_image=None, flex_inpaint_mask=None, flex_control_image=None,
                 flex_control_strength: float = 0.5, flex_control_stop: float = 0.5,
                 value_controller_inputs=None, lora_encoder_inputs=None, lora_encoder_scale: float | None = None,
                 nexus_gen_reference_image=None, insert_anything_source_image=None, insert_anything_source_mask=None,
                 insert_anything_ref_image=None, insert_anything_ref_mask=None, insert_anything_size: int = 768,
                 progress: bool = True,
                 output_type: str = "pil"):
        """The reference's arguments for every variant (docs/flux.md); `kontext_images`: a reference image, a list of
        them, or one list per prompt."""
        values = self.prompt_values(prompt, negative_prompt)
        n = values["batch_size"]
        if controlnet_inputs is not None:
            if controlnet_image is not None:
                raise UserError("give controlnet_inputs or controlnet_image, not both")
            given = controlnet_call_inputs(controlnet_inputs)
            controlnet_image, controlnet_inpaint_mask = given["controlnet_image"], given["controlnet_inpaint_mask"]
            controlnet_processor_id, controlnet_scale = given["controlnet_processor_id"], given["controlnet_scale"]
        crop = None
        if insert_anything_source_image is not None:  # the diptych here, pasted back after sampling
            parts = (insert_anything_source_image, insert_anything_source_mask, insert_anything_ref_image,
                     insert_anything_ref_mask)
            if any(p is None for p in parts):
                raise UserError("Insert-Anything needs insert_anything_source_image, _source_mask, _ref_image and "
                                "_ref_mask")
            inputs, crop = prepare(*parts, size=insert_anything_size)
            flux_fill_image, flux_fill_mask = inputs["flux_fill_image"], inputs["flux_fill_mask"]
            flux_redux_image, height, width = inputs["flux_redux_image"], inputs["height"], inputs["width"]
        if input_image is not None and (height is None or width is None):
            width, height = as_image_list(input_image)[0].size
        prompts = text_list(eligen_entity_prompts, "eligen_entity_prompts", "(call)")
        if (prompts is None) != (eligen_entity_masks is None):
            raise UserError("EliGen needs both eligen_entity_prompts and eligen_entity_masks")
        if nexus_gen_reference_image is not None and cfg_scale != 1.0:
            raise UserError("Nexus-Gen editing samples with cfg_scale 1 (the reference's editing adapter gives the "
                            "positive side only)")
        values.update({
            "height": height, "width": width, "seed": seed, "input_image": input_image,
            "embedded_guidance": embedded_guidance, "kontext_images": kontext_images,
            "controlnet_image": controlnet_image, "controlnet_inpaint_mask": controlnet_inpaint_mask,
            "controlnet_processor_id": controlnet_processor_id, "controlnet_scale": controlnet_scale,
            "flux_fill_image": flux_fill_image, "flux_fill_mask": flux_fill_mask, "flux_redux_image": flux_redux_image,
            "ipadapter_images": ipadapter_images, "ipadapter_scale": ipadapter_scale,
            "infinityou_id_image": infinityou_id_image, "infinityou_face_embedding": infinityou_face_embedding,
            "infinityou_guidance": infinityou_guidance if infinityou_id_image is not None or
            infinityou_face_embedding is not None else None,
            "eligen_entity_prompts": prompts, "eligen_entity_masks": eligen_entity_masks,
            "flex_inpaint_image": flex_inpaint_image, "flex_inpaint_mask": flex_inpaint_mask,
            "flex_control_image": flex_control_image,
            "flex_control_strength": flex_control_strength if flex_control_image is not None else None,
            "flex_control_stop": flex_control_stop if flex_control_image is not None else None,
            "value_controller_inputs": value_controller_inputs, "lora_encoder_inputs": lora_encoder_inputs,
            "lora_encoder_scale": lora_encoder_scale, "nexus_gen_reference_image": nexus_gen_reference_image,
        })
        if eligen_enable_on_negative and prompts is not None:  # the negative prompt in every entity's place
            values["negative_eligen_entity_prompts"] = [values["negative_prompt"][0]] * len(prompts)
        out = self.generate(values, cfg_scale=cfg_scale, num_inference_steps=num_inference_steps,
                            denoising_strength=denoising_strength, progress=progress, output_type=output_type)
        if crop is not None and output_type == "pil":
            out = [paste_back(image, crop) for image in out]
        return out[0] if isinstance(prompt, str) and output_type == "pil" and n == 1 else out


def _images(value, column: str, where: str):
    """An image column's value: PIL image(s), as loaded from files named in --data_file_keys / --extra_inputs (file
    names of a column no flag names are refused, not ignored)."""
    if value is None:
        return None
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(v, Image.Image) for v in items):
        raise UserError(f"{where}: '{column}' must be image file(s) listed in --data_file_keys (e.g. --data_file_keys "
                        f"image,{column}), got {value!r:.60}")
    return value


__all__ = ["CALL_DEFAULTS", "FluxImagePipeline", "IMAGE_COLUMNS"]
