"""`ErnieImagePipeline`: ERNIE-Image (text-to-image, and image-to-image from an input image): inference and the
training hooks. The reference trains it on images and prompts only, so the pipeline has no features."""

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
from ...parts import flux2_vae
from .components import BN_EPS, SCHEDULER_CONFIG
from .model_fn import model_fn_ernie_image
from .prompt import ErnieImagePromptEmbedder
from .units import DIVISION_FACTOR, ErnieImageInputImageEmbedder, ErnieImageNoiseInitializer, ErnieImageShapeChecker

# Every sampling default of the family (diffusers' ErnieImagePipeline and the reference's: 50 steps, guidance 4).
def _decode(pipe, latents):
    return flux2_vae.decode(pipe.vae, latents.to(pipe.device), eps=BN_EPS)


CALL_DEFAULTS = {"height": 1024, "width": 1024, "num_inference_steps": 50, "cfg_scale": 4.0}


class ErnieImagePipeline(BasePipeline):
    model_names = ("dit", "text_encoder", "vae")
    settings = frozenset({"batch_size", "rand_device", "use_gradient_checkpointing",
                          "use_gradient_checkpointing_offload"})
    model_fn_inputs = ("prompt_embeds", "prompt_embeds_mask")
    padding_masks = ("prompt_embeds_mask",)
    data_inputs = ("image", "prompt", "seed", "rand_device", "num_inference_steps", "height", "width")
    input_batching = {"num_inference_steps": SAME, "height": SAME, "width": SAME, "rand_device": SAME}
    batch_shared_inputs = ("height", "width", "rand_device")
    loss_models = ("dit",)
    call_defaults = CALL_DEFAULTS
    target = Target((ImageStream(channels=flux2_vae.PATCHED_CHANNELS, scale=DIVISION_FACTOR, patch=1,
                                 division=DIVISION_FACTOR, decoder=_decode),))

    def __init__(self, device="cpu", torch_dtype=torch.float32, scheduler=None):
        super().__init__(device, torch_dtype)
        self.scheduler = scheduler or self.default_scheduler()
        self.tokenizer = None
        self.units = [ErnieImageShapeChecker(), ErnieImageNoiseInitializer(), ErnieImageInputImageEmbedder(),
                      ErnieImagePromptEmbedder()]

    @staticmethod
    def default_scheduler():
        """ERNIE-Image's scheduler config (a static shift of 3), which the reference also trains at."""
        from ...schedulers import FlowMatchScheduler

        return FlowMatchScheduler(**SCHEDULER_CONFIG)

    # -- model_fn -------------------------------------------------------------------------------------
    def model_fn(self, latents, timestep, prompt_embeds, prompt_embeds_mask=None, **inputs):
        if self.dit is None:
            raise UserError("no ERNIE-Image DiT loaded")
        return model_fn_ernie_image(self.dit, latents, timestep, prompt_embeds, prompt_embeds_mask, **inputs)

    def set_timesteps(self, values, num_inference_steps: int, denoising_strength: float = 1.0) -> None:
        """A static shift of 3 over linspace(1, 1/N, N) (diffusers' pipeline); image-to-image takes the reference's
        schedule (all steps from sigma = strength)."""
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
        return {
            "prompt": prompt, "negative_prompt": "", "input_image": image,
            "height": image.size[1] if image is not None else data.get("height"),
            "width": image.size[0] if image is not None else data.get("width"),
            "seed": data.get("seed"), "rand_device": data.get("rand_device") or "cpu", "batch_size": 1,
            "num_inference_steps": data.get("num_inference_steps"),
        }

    def batch_signature(self, sample: dict[str, Any]) -> tuple:
        image = sample.get("image")
        return (image.size if isinstance(image, Image.Image) else image, sample.get("rand_device") or "cpu")

    # -- inference ------------------------------------------------------------------------------------
    def __call__(self, prompt: str | list[str], negative_prompt: str | list[str] = "",
                 cfg_scale: float = CALL_DEFAULTS["cfg_scale"], height: int | None = CALL_DEFAULTS["height"],
                 width: int | None = CALL_DEFAULTS["width"],
                 num_inference_steps: int = CALL_DEFAULTS["num_inference_steps"], seed: int | None = None,
                 input_image=None, denoising_strength: float = 1.0, rand_device: str = "cpu", progress: bool = True,
                 output_type: str = "pil"):
        """`cfg_scale` is both the reference's and diffusers' `guidance_scale` (nega + s * (posi - nega))."""
        values = self.prompt_values(prompt, negative_prompt)
        if input_image is not None and (height is None or width is None):
            width, height = as_image_list(input_image)[0].size
        values.update({"height": height, "width": width, "seed": seed, "rand_device": rand_device,
                       "input_image": input_image})
        out = self.generate(values, cfg_scale=cfg_scale, num_inference_steps=num_inference_steps,
                            denoising_strength=denoising_strength, progress=progress, output_type=output_type)
        return out[0] if isinstance(prompt, str) and output_type == "pil" else out


__all__ = ["CALL_DEFAULTS", "ErnieImagePipeline"]
