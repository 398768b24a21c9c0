"""`ZImagePipeline`: Z-Image, Z-Image-Turbo, Z-Image-Omni-Base (text-to-image and image(s)-to-image) and the Turbo
Fun ControlNets: inference and the training hooks.

One pipeline class with three features (`core/features.py`): `edit` (Omni-Base's edit images: VAE latents, SigLIP2
features and the prompt cut around the images' slots), `controlnet` (a Fun ControlNet's control image) and `omni`
(Omni-Base's DiT, read from its config). None changes the latent layout, the sampler or the guidance; which forward
the DiT runs follows from the loaded DiT (as in the reference), so no variant class is needed and stage 1 may name
no DiT.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from PIL import Image

from ...core.batch import SAME
from ...core.features import Feature
from ...core.pipeline import BasePipeline
from ...errors import UserError
from ...media.image import as_image_list
from ...parts.flux_ae import LATENT_CHANNELS, VAE_SCALE, vae_decode
from .components import SCHEDULER_CONFIG
from .controlnet import CONTROL_COLUMNS, ZImageControlEmbedder
from .edit import ZImageEditImageEmbedder, ZImageSiglipEmbedder
from .model_fn import model_fn_z_image
from .prompt import ZImageEditPromptEmbedder, ZImageEditTextEmbedder, ZImagePromptEmbedder
from .units import DIVISION_FACTOR, ZImageInputImageEmbedder, ZImageNoiseInitializer, ZImageShapeChecker

# Every sampling default of the family (the reference's and Z-Image-Turbo's: 8 steps without guidance).
CALL_DEFAULTS = {"height": 1024, "width": 1024, "num_inference_steps": 8, "cfg_scale": 1.0}


def omni_dit(context) -> bool:
    return (context.config("dit") or {}).get("siglip_feat_dim") is not None


EDIT = Feature("edit", columns=("edit_image",), model_fn_inputs=("edit_latents", "siglip_embeds", "edit_text_embeds"),
               description="Omni-Base image(s)-to-image: edit images as VAE latents and SigLIP2 features, the prompt "
                           "around their slots")
CONTROLNET = Feature("controlnet", columns=CONTROL_COLUMNS, models=("controlnet",),
                     model_fn_inputs=("control_context",),
                     description="Z-Image-Turbo Fun ControlNet (Union / Tile 2.1 and 8-step): a control image")
OMNI = Feature("omni", when=omni_dit, description="Omni-Base's DiT (its config's siglip_feat_dim): the omni forward")


class ZImagePipeline(BasePipeline):
    model_names = ("dit", "text_encoder", "vae", "image_encoder", "controlnet")
    settings = frozenset({"batch_size", "rand_device", "use_gradient_checkpointing",
                          "use_gradient_checkpointing_offload", "control_inpaint_latents"})
    model_fn_inputs = ("prompt_embeds", "prompt_embeds_mask")
    padding_masks = ("prompt_embeds_mask",)
    features = (EDIT, CONTROLNET, OMNI)
    data_inputs = ("image", "prompt", "seed", "rand_device", "num_inference_steps", "height", "width")
    input_batching = {"num_inference_steps": SAME, "height": SAME, "width": SAME, "rand_device": SAME}
    batch_shared_inputs = ("height", "width", "rand_device")
    loss_models = ("dit", "controlnet")  # model_fn runs the ControlNet when one is loaded
    decode_models = ("vae",)
    division_factor = DIVISION_FACTOR
    call_defaults = CALL_DEFAULTS
    patch_size = 2
    vae_scale = VAE_SCALE
    latent_channels = LATENT_CHANNELS

    def __init__(self, device="cpu", torch_dtype=torch.float32, scheduler=None):
        super().__init__(device, torch_dtype)
        self.scheduler = scheduler or self.default_scheduler()
        self.tokenizer = None
        self.units = [ZImageShapeChecker(), ZImageNoiseInitializer(), ZImageInputImageEmbedder(),
                      ZImagePromptEmbedder(), ZImageEditPromptEmbedder(), ZImageEditTextEmbedder(),
                      ZImageEditImageEmbedder(), ZImageSiglipEmbedder(), ZImageControlEmbedder()]

    @staticmethod
    def default_scheduler():
        """Z-Image's scheduler config (a static shift of 3), which the reference also trains at."""
        from ...schedulers import FlowMatchScheduler

        return FlowMatchScheduler(**SCHEDULER_CONFIG)

    @classmethod
    def check_run(cls, context, features):
        """Models and data that cannot go together, refused before any work (a stage that names no DiT is let
        through: its units do not need it)."""
        dit = context.config("dit")
        if "edit" in features:
            if dit is not None and not omni_dit(context):
                raise UserError("edit_image: edit images need Z-Image-Omni-Base's DiT "
                                "(Tongyi-MAI/Z-Image-Omni-Base:transformer/); this DiT has no SigLIP embedder")
            if context.config("image_encoder") is None:
                raise UserError("edit_image: Omni-Base's edit images need its SigLIP2 image encoder "
                                "(Tongyi-MAI/Z-Image-Omni-Base:siglip/model.safetensors) in the model flags")
        if "controlnet" in features:
            has_control = context.has(*CONTROL_COLUMNS)
            if context.config("controlnet") is not None and not has_control:
                raise UserError("a Fun ControlNet is loaded but the data has no control image: add the column "
                                "controlnet_image (--data_file_keys image,controlnet_image --extra_inputs "
                                "controlnet_image)")
            if has_control and dit is not None and context.config("controlnet") is None:
                raise UserError("controlnet_image: no Fun ControlNet loaded; add its file (e.g. PAI/Z-Image-Turbo-"
                                "Fun-Controlnet-Union-2.1:Z-Image-Turbo-Fun-Controlnet-Union-2.1.safetensors) to the "
                                "model flags")
            if dit is not None and omni_dit(context):
                raise UserError("the Fun ControlNets work with Z-Image(-Turbo)'s DiT, not Omni-Base's")

    # -- model_fn -------------------------------------------------------------------------------------
    def model_fn(self, latents, timestep, prompt_embeds, prompt_embeds_mask=None, edit_latents=None,
                 siglip_embeds=None, edit_text_embeds=None, control_context=None, control_scale=None,
                 control_refiner_hints=True, **settings):
        if self.dit is None:
            raise UserError("no Z-Image DiT loaded")
        return model_fn_z_image(self.dit, latents, timestep, prompt_embeds, prompt_embeds_mask, edit_latents,
                                siglip_embeds, edit_text_embeds, controlnet=self.models.get("controlnet"),
                                control_context=control_context, control_scale=control_scale,
                                control_refiner_hints=control_refiner_hints, **settings)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return vae_decode(self, latents)

    def set_timesteps(self, values, num_inference_steps: int, denoising_strength: float = 1.0) -> None:
        """Z-Image's static shift; image-to-image takes the reference's schedule (all steps from sigma = strength)."""
        self.scheduler.set_timesteps(num_inference_steps, denoising_strength=denoising_strength,
                                     strength_mode="diffsynth" if denoising_strength < 1 else "diffusers")

    # -- training -------------------------------------------------------------------------------------
    def training_inputs(self, data: dict[str, Any]) -> dict[str, Any]:
        row = data.get("_row", "?")
        image = data.get("image")
        if image is not None and not isinstance(image, Image.Image):
            raise UserError(f"row {row}: 'image' must be an image file listed in --data_file_keys")
        prompt = data.get("prompt", "")
        if prompt is None or (isinstance(prompt, float) and math.isnan(prompt)):
            prompt = ""
        values = {
            "prompt": prompt, "negative_prompt": "", "input_image": image,
            "height": image.size[1] if image is not None else data.get("height"),
            "width": image.size[0] if image is not None else data.get("width"),
            "seed": data.get("seed"), "rand_device": data.get("rand_device") or "cpu", "batch_size": 1,
            "num_inference_steps": data.get("num_inference_steps"),
            "edit_image": _edit_images(data.get("edit_image"), row) if self._uses("edit") else None,
        }
        for column in CONTROL_COLUMNS:
            value = data.get(column) if self._uses("controlnet") else None
            if value is not None and not isinstance(value, Image.Image):
                raise UserError(f"row {row}: '{column}' must be an image file listed in --data_file_keys "
                                f"(e.g. --data_file_keys image,{column})")
            values[column] = value
        return values

    def _uses(self, feature: str) -> bool:
        """Whether the run uses `feature` (a metadata column the run does not name, as --extra_inputs or
        --data_file_keys, is left alone, as the reference leaves it)."""
        return self.active_features is None or feature in self.active_features

    @staticmethod
    def batch_signature(sample: dict[str, Any]) -> tuple:
        def size(v):
            return v.size if isinstance(v, Image.Image) else tuple(map(size, v)) if isinstance(v, list) else v

        return (*(size(sample.get(k)) for k in ("image", "edit_image", *CONTROL_COLUMNS)),
                sample.get("rand_device") or "cpu")

    # -- inference ------------------------------------------------------------------------------------
    def __call__(self, prompt: str | list[str], negative_prompt: str | list[str] = "",
                 cfg_scale: float = CALL_DEFAULTS["cfg_scale"], height: int | None = CALL_DEFAULTS["height"],
                 width: int | None = CALL_DEFAULTS["width"],
                 num_inference_steps: int = CALL_DEFAULTS["num_inference_steps"], seed: int | None = None,
                 input_image=None, denoising_strength: float = 1.0, edit_image=None, controlnet_image=None,
                 controlnet_inpaint_mask=None, controlnet_inpaint_image=None, controlnet_scale: float = 1.0,
                 control_compat: str = "reference", rand_device: str = "cpu", progress: bool = True,
                 output_type: str = "pil"):
        """`cfg_scale` is the reference's (nega + s * (posi - nega)); diffusers' `guidance_scale` g is s = 1 + g.
        `edit_image` (Omni-Base): an image or a list of them. `control_compat="diffusers"` samples a Fun ControlNet
        as diffusers' `ZImageControlNetPipeline` does (zero inpaint latents, no refiner hints in the DiT's stream);
        the default is the reference's (and the model authors') forward."""
        if control_compat not in ("reference", "diffusers"):
            raise UserError(f"control_compat must be 'reference' or 'diffusers', got {control_compat!r}")
        values = self.prompt_values(prompt, negative_prompt)
        if input_image is not None and (height is None or width is None):
            width, height = as_image_list(input_image)[0].size
        values.update({
            "height": height, "width": width, "seed": seed, "rand_device": rand_device, "input_image": input_image,
            "edit_image": edit_image, "controlnet_image": controlnet_image,
            "controlnet_inpaint_mask": controlnet_inpaint_mask, "controlnet_inpaint_image": controlnet_inpaint_image,
            "control_inpaint_latents": "zeros" if control_compat == "diffusers" else "encoded",
        })
        settings = {"control_scale": controlnet_scale, "control_refiner_hints": control_compat == "reference"}
        out = self.generate(values, cfg_scale=cfg_scale, num_inference_steps=num_inference_steps,
                            denoising_strength=denoising_strength, settings=settings, progress=progress,
                            output_type=output_type)
        return out[0] if isinstance(prompt, str) and output_type == "pil" else out


def _edit_images(value, row):
    """A row's edit image(s) as a list (so a stage-1 batch holds one list per sample)."""
    if value is None:
        return None
    if isinstance(value, Image.Image):
        return [value]
    if isinstance(value, list) and value and all(isinstance(v, Image.Image) for v in value):
        return value
    raise UserError(f"row {row}: 'edit_image' must be image file(s) listed in --data_file_keys "
                    f"(e.g. --data_file_keys image,edit_image)")
