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
from ...core.pipeline import BasePipeline
from ...core.target import ImageStream, Target
from ...errors import UserError
from ...media.image import as_image_list
from ...parts.flux_ae import LATENT_CHANNELS, VAE_SCALE, vae_decode
from .components import SCHEDULER_CONFIG
from .controlnet import CONTROLNET
from .edit import EDIT, OMNI
from .model_fn import model_fn_z_image
from .prompt import ZImagePromptEmbedder
from .units import DIVISION_FACTOR, ZImageInputImageEmbedder, ZImageNoiseInitializer, ZImageShapeChecker

# Every sampling default of the family (the reference's and Z-Image-Turbo's: 8 steps without guidance).
CALL_DEFAULTS = {"height": 1024, "width": 1024, "num_inference_steps": 8, "cfg_scale": 1.0}


class ZImagePipeline(BasePipeline):
    model_names = ("dit", "text_encoder", "vae")
    settings = frozenset({"batch_size", "rand_device", "use_gradient_checkpointing",
                          "use_gradient_checkpointing_offload", "control_inpaint_latents"})
    model_fn_inputs = ("prompt_embeds", "prompt_embeds_mask")
    padding_masks = ("prompt_embeds_mask",)
    features = (EDIT, CONTROLNET, OMNI)  # each its own module (edit.py, controlnet.py)
    data_inputs = ("image", "prompt", "seed", "rand_device", "num_inference_steps", "height", "width")
    input_batching = {"num_inference_steps": SAME, "height": SAME, "width": SAME, "rand_device": SAME}
    batch_shared_inputs = ("height", "width", "rand_device")
    loss_models = ("dit",)
    call_defaults = CALL_DEFAULTS
    target = Target((ImageStream(channels=LATENT_CHANNELS, scale=VAE_SCALE, patch=2,
                                 division=DIVISION_FACTOR, decoder=vae_decode),))

    def __init__(self, device="cpu", torch_dtype=torch.float32, scheduler=None):
        super().__init__(device, torch_dtype)
        self.scheduler = scheduler or self.default_scheduler()
        self.tokenizer = None
        self.units = [ZImageShapeChecker(), ZImageNoiseInitializer(), ZImageInputImageEmbedder(),
                      ZImagePromptEmbedder()]

    @staticmethod
    def default_scheduler():
        """Z-Image's scheduler config (a static shift of 3), which the reference also trains at."""
        from ...schedulers import FlowMatchScheduler

        return FlowMatchScheduler(**SCHEDULER_CONFIG)

    # -- model_fn -------------------------------------------------------------------------------------
    def model_fn(self, latents, timestep, prompt_embeds, prompt_embeds_mask=None, **inputs):
        if self.dit is None:
            raise UserError("no Z-Image DiT loaded")
        return model_fn_z_image(self.dit, latents, timestep, prompt_embeds, prompt_embeds_mask, pipe=self,
                                features=self.features, **inputs)

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
            **dict.fromkeys(self.input_kinds()),
        }
        # the columns of the run's features only: a metadata column the run does not name (as --extra_inputs or
        # --data_file_keys) is left alone, as the reference leaves it
        used = {"_row": row}
        for feature in self.features:
            if self.active_features is None or feature.name in self.active_features:
                used.update({name: data.get(name) for name in feature.inputs})
        values.update(self.feature_data(used))
        return values

    def batch_signature(self, sample: dict[str, Any]) -> tuple:
        def size(v):
            return v.size if isinstance(v, Image.Image) else tuple(map(size, v)) if isinstance(v, list) else v

        return (*(size(sample.get(k)) for k in ("image", *self.input_kinds())), sample.get("rand_device") or "cpu")

    # -- inference ------------------------------------------------------------------------------------
    def __call__(self, prompt: str | list[str], negative_prompt: str | list[str] = "",
                 cfg_scale: float = CALL_DEFAULTS["cfg_scale"], height: int | None = CALL_DEFAULTS["height"],
                 width: int | None = CALL_DEFAULTS["width"],
                 num_inference_steps: int = CALL_DEFAULTS["num_inference_steps"], seed: int | None = None,
                 input_image=None, denoising_strength: float = 1.0, rand_device: str = "cpu", progress: bool = True,
                 output_type: str = "pil", **inputs):
        """`cfg_scale` is the reference's (nega + s * (posi - nega)); diffusers' `guidance_scale` g is s = 1 + g.
        `inputs`: the features' by the reference's names (`call_inputs()` lists them; edit.py and controlnet.py say
        what each takes: Omni-Base's edit images, a Fun ControlNet's control image, strength and forward)."""
        given, _ = self.take_call_inputs(inputs)
        features, settings = {}, {}
        for feature in self.features:
            more, more_settings = feature.call_values(given)
            features.update(more)
            settings.update(more_settings)
        values = self.prompt_values(prompt, negative_prompt)
        if input_image is not None and (height is None or width is None):
            width, height = as_image_list(input_image)[0].size
        values.update({"height": height, "width": width, "seed": seed, "rand_device": rand_device,
                       "input_image": input_image, **features})
        out = self.generate(values, cfg_scale=cfg_scale, num_inference_steps=num_inference_steps,
                            denoising_strength=denoising_strength, settings=settings, progress=progress,
                            output_type=output_type)
        return out[0] if isinstance(prompt, str) and output_type == "pil" else out


__all__ = ["CALL_DEFAULTS", "ZImagePipeline"]
