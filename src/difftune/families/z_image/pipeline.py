"""`ZImagePipeline`: Z-Image, Z-Image-Turbo, Z-Image-Omni-Base (text-to-image and image(s)-to-image) and the
Turbo Fun ControlNets, inference and the training hooks.

One pipeline class with three features (`core/features.py`): Omni-Base's edit images (`edit`: VAE latents and
SigLIP2 features), the Fun ControlNet (`controlnet`), and none for plain text-to-image. None of them changes the
latent layout, the sampler or the guidance: Omni-Base is told apart by its DiT (a SigLIP embedder), which
`model_fn` reads from the loaded model, so no pipeline subclass is needed.
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
from ...media.image import as_image_list, tensor_to_images
from .components import SCHEDULER_CONFIG
from .model_fn import model_fn_z_image
from .units import (DIVISION_FACTOR, LATENT_CHANNELS, VAE_SCALE, ZImageControlEmbedder, ZImageEditImageEmbedder,
                    ZImageInputImageEmbedder, ZImageNoiseInitializer, ZImagePromptEmbedder, ZImageShapeChecker,
                    ZImageSiglipEmbedder, vae_decode)

CONTROL_COLUMNS = ("controlnet_image", "controlnet_inpaint_mask", "controlnet_inpaint_image")


def _is_omni(context) -> bool:
    config = context.config("dit") or {}
    return config.get("siglip_feat_dim") is not None


class ZImagePipeline(BasePipeline):
    family = "z_image"
    model_names = ("dit", "text_encoder", "vae", "image_encoder", "controlnet")
    settings = frozenset({"batch_size", "use_gradient_checkpointing", "use_gradient_checkpointing_offload",
                          "control_inpaint_latents"})
    model_fn_settings = ("use_gradient_checkpointing", "use_gradient_checkpointing_offload")
    model_fn_inputs = ("prompt_embeds", "prompt_embeds_mask", "prompt_pieces", "edit_latents", "siglip_embeds",
                       "control_context")
    data_inputs = ("image", "prompt", "seed", "edit_image", *CONTROL_COLUMNS, "num_inference_steps", "height",
                   "width")
    input_batching = {"num_inference_steps": SAME, "height": SAME, "width": SAME}
    loss_models = ("dit", "controlnet")  # model_fn runs the ControlNet when one is loaded
    decode_models = ("vae",)
    division_factor = DIVISION_FACTOR
    patch_size = 2
    vae_scale = VAE_SCALE
    latent_channels = LATENT_CHANNELS
    features = (
        Feature(name="edit", columns=("edit_image",), models=("image_encoder",), requires=(),
                model_fn_inputs=("edit_latents", "siglip_embeds", "prompt_pieces"),
                description="Omni-Base image(s)-to-image: edit images as VAE latents and SigLIP2 features"),
        Feature(name="controlnet", columns=CONTROL_COLUMNS, models=("controlnet",),
                model_fn_inputs=("control_context",),
                description="Z-Image-Turbo Fun ControlNet (Union / Tile 2.1): a control image"),
        Feature(name="omni", when=_is_omni, description="Omni-Base's DiT (read from its config: siglip_feat_dim)"),
    )

    def __init__(self, device="cpu", torch_dtype=torch.float32, scheduler=None):
        super().__init__(device, torch_dtype)
        self.scheduler = scheduler or self.default_scheduler()
        self.tokenizer = None
        self.siglip_processor = None
        self.units = [ZImageShapeChecker(), ZImageNoiseInitializer(), ZImageInputImageEmbedder(),
                      ZImagePromptEmbedder(), ZImageEditImageEmbedder(), ZImageSiglipEmbedder(),
                      ZImageControlEmbedder()]

    @staticmethod
    def default_scheduler():
        """Z-Image's scheduler config (a static shift of 3), which the reference also trains at."""
        from ...schedulers import FlowMatchScheduler

        return FlowMatchScheduler(**SCHEDULER_CONFIG)

    def model_fn(self, latents, timestep, prompt_embeds, prompt_embeds_mask=None, prompt_pieces=None,
                 edit_latents=None, siglip_embeds=None, control_context=None, control_scale=None,
                 control_refiner_hints=True, **settings):
        return model_fn_z_image(self.dit, latents, timestep, prompt_embeds, prompt_embeds_mask, prompt_pieces,
                                edit_latents, siglip_embeds, controlnet=self.models.get("controlnet"),
                                control_context=control_context, control_scale=control_scale,
                                control_refiner_hints=control_refiner_hints, **settings)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return vae_decode(self, latents)

    # -- training -------------------------------------------------------------------------------------
    def training_inputs(self, data: dict[str, Any]) -> dict[str, Any]:
        image = data.get("image")
        if image is not None and not isinstance(image, Image.Image):
            raise UserError(f"row {data.get('_row', '?')}: 'image' must be an image file listed in --data_file_keys")
        prompt = data.get("prompt", "")
        if prompt is None or (isinstance(prompt, float) and math.isnan(prompt)):
            prompt = ""
        values = {
            "prompt": prompt, "negative_prompt": "", "input_image": image,
            "height": image.size[1] if image is not None else data.get("height"),
            "width": image.size[0] if image is not None else data.get("width"),
            "seed": data.get("seed"), "batch_size": 1, "num_inference_steps": data.get("num_inference_steps"),
            "edit_image": _edit_images(data.get("edit_image"), data.get("_row")),
        }
        for column in CONTROL_COLUMNS:
            value = data.get(column)
            if value is not None and not isinstance(value, Image.Image):
                raise UserError(f"row {data.get('_row', '?')}: '{column}' must be an image file listed in "
                                f"--data_file_keys (e.g. --data_file_keys image,{column})")
            values[column] = value
        return values

    @staticmethod
    def batch_signature(sample: dict[str, Any]) -> tuple:
        def size(v):
            return v.size if isinstance(v, Image.Image) else tuple(map(size, v)) if isinstance(v, list) else v

        return tuple(size(sample.get(k)) for k in ("image", "edit_image", *CONTROL_COLUMNS))

    # -- inference ------------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, prompt: str | list[str], negative_prompt: str | list[str] = "", cfg_scale: float = 1.0,
                 height: int | None = 1024, width: int | None = 1024, num_inference_steps: int = 8,
                 seed: int | None = None, input_image=None, denoising_strength: float = 1.0, edit_image=None,
                 controlnet_image=None, controlnet_inpaint_mask=None, controlnet_inpaint_image=None,
                 controlnet_scale: float = 1.0, control_compat: str = "reference", progress: bool = True,
                 output_type: str = "pil"):
        """`cfg_scale` is the reference's (nega + s * (posi - nega)); diffusers' `guidance_scale` g is s = 1 + g.
        `edit_image` (Omni-Base): an image or a list of them. `control_compat="diffusers"` samples a Fun ControlNet
        as diffusers' `ZImageControlNetPipeline` does (zero inpaint latents, no refiner hints in the DiT's stream);
        the default is the reference's (and the model authors') forward."""
        if control_compat not in ("reference", "diffusers"):
            raise UserError(f"control_compat must be 'reference' or 'diffusers', got {control_compat!r}")
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        negatives = [negative_prompt] * len(prompts) if isinstance(negative_prompt, str) else list(negative_prompt)
        if input_image is not None and (height is None or width is None):
            width, height = as_image_list(input_image)[0].size
        values: dict[str, Any] = {
            "prompt": prompts, "negative_prompt": negatives, "height": height, "width": width, "seed": seed,
            "batch_size": len(prompts), "input_image": input_image, "edit_image": edit_image,
            "controlnet_image": controlnet_image, "controlnet_inpaint_mask": controlnet_inpaint_mask,
            "controlnet_inpaint_image": controlnet_inpaint_image,
            "control_inpaint_latents": "zeros" if control_compat == "diffusers" else "encoded",
        }
        # the reference's img2img schedule (all steps from sigma = strength); at strength 1 diffusers' exact one
        self.scheduler.set_timesteps(num_inference_steps, denoising_strength=denoising_strength,
                                     strength_mode="diffsynth" if denoising_strength < 1 else "diffusers")
        self.run_units(values, cfg=cfg_scale != 1.0)
        settings = {"control_scale": controlnet_scale, "control_refiner_hints": control_compat == "reference"}
        latents = self.denoise(values, cfg_scale=cfg_scale, progress=progress, settings=settings)
        if output_type == "latent":
            return latents
        images = vae_decode(self, latents)
        if output_type == "pt":
            return (images.float() / 2 + 0.5).clamp(0, 1)
        pil = tensor_to_images(images)
        return pil[0] if isinstance(prompt, str) else pil


def _edit_images(value, row):
    if value is None:
        return None
    if isinstance(value, Image.Image):
        return value
    if isinstance(value, list) and value and all(isinstance(v, Image.Image) for v in value):
        return value
    raise UserError(f"row {row if row is not None else '?'}: 'edit_image' must be image file(s) listed in "
                    f"--data_file_keys (e.g. --data_file_keys image,edit_image)")
