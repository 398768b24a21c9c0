"""`Krea2Pipeline`: Krea-2 Raw and Turbo (text-to-image, image-to-image): inference and the training hooks.

One pipeline with no features: the reference's Krea-2 scripts feed an image and a prompt only. Raw samples with the
resolution-aware time shift (mu from the image's token count, as diffusers); Turbo, the few-step distilled
checkpoint, with a fixed mu of 1.15 (`mu=1.15`, 8 steps, cfg_scale 1, as the reference's Turbo example).
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
from ...parts.qwen_image_vae import vae_decode
from .components import SCHEDULER_CONFIG, TRAINING_MU
from .model_fn import model_fn_krea2
from .prompt import Krea2PromptEmbedder
from .units import (DIVISION_FACTOR, LATENT_CHANNELS, VAE_SCALE, Krea2InputImageEmbedder, Krea2NoiseInitializer,
                    Krea2ShapeChecker)

# Every sampling default of the family (the reference's Raw defaults; `cfg_scale` is the reference's
# nega + s * (posi - nega), so diffusers' guidance_scale g is s = 1 + g).
CALL_DEFAULTS = {"height": 1024, "width": 1024, "num_inference_steps": 52, "cfg_scale": 3.5}


class Krea2Pipeline(BasePipeline):
    model_names = ("dit", "text_encoder", "vae")
    settings = frozenset({"batch_size", "rand_device", "use_gradient_checkpointing",
                          "use_gradient_checkpointing_offload"})
    model_fn_inputs = ("prompt_embeds", "prompt_embeds_mask")
    padding_masks = ("prompt_embeds_mask",)
    data_inputs = ("image", "prompt", "seed", "rand_device", "height", "width")
    input_batching = {"height": SAME, "width": SAME, "rand_device": SAME}
    batch_shared_inputs = ("height", "width", "rand_device")
    loss_models = ("dit",)
    call_defaults = CALL_DEFAULTS
    target = Target((ImageStream(channels=LATENT_CHANNELS, scale=VAE_SCALE, patch=2,
                                 division=DIVISION_FACTOR, decoder=vae_decode),))

    def __init__(self, device="cpu", torch_dtype=torch.float32, scheduler=None):
        super().__init__(device, torch_dtype)
        self.scheduler = scheduler or self.default_scheduler()
        self.tokenizer = None
        self.units = [Krea2ShapeChecker(), Krea2NoiseInitializer(), Krea2InputImageEmbedder(), Krea2PromptEmbedder()]

    @staticmethod
    def default_scheduler():
        """Krea-2's dynamic exponential shift, trained at the reference's fixed mu of 0.8."""
        from ...schedulers import FlowMatchScheduler

        return FlowMatchScheduler(training_mu=TRAINING_MU, **SCHEDULER_CONFIG)

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

    # -- training -------------------------------------------------------------------------------------
    def training_inputs(self, data: dict[str, Any]) -> dict[str, Any]:
        row = data.get("_row", "?")
        image = data.get("image")
        if image is not None and not isinstance(image, Image.Image):
            raise UserError(f"row {row}: 'image' must be an image file listed in --data_file_keys")
        prompt = data.get("prompt", "")
        if prompt is None or (isinstance(prompt, float) and math.isnan(prompt)):
            prompt = ""
        return {"prompt": prompt, "negative_prompt": "", "input_image": image,
                "height": image.size[1] if image is not None else data.get("height"),
                "width": image.size[0] if image is not None else data.get("width"),
                "seed": data.get("seed"), "rand_device": data.get("rand_device") or "cpu", "batch_size": 1}

    def batch_signature(self, sample: dict[str, Any]) -> tuple:
        image = sample.get("image")
        return (image.size if isinstance(image, Image.Image) else None, sample.get("rand_device") or "cpu")

    # -- inference ------------------------------------------------------------------------------------
    def __call__(self, prompt: str | list[str], negative_prompt: str | list[str] = "",
                 cfg_scale: float = CALL_DEFAULTS["cfg_scale"], height: int | None = CALL_DEFAULTS["height"],
                 width: int | None = CALL_DEFAULTS["width"],
                 num_inference_steps: int = CALL_DEFAULTS["num_inference_steps"], seed: int | None = None,
                 mu: float | None = None, input_image=None, denoising_strength: float = 1.0,
                 rand_device: str = "cpu", progress: bool = True, output_type: str = "pil"):
        """`mu`: a fixed time shift (Turbo: 1.15); None: from the image size (Raw)."""
        values = self.prompt_values(prompt, negative_prompt)
        if input_image is not None and (height is None or width is None):
            width, height = as_image_list(input_image)[0].size
        values.update({"height": height, "width": width, "seed": seed, "rand_device": rand_device,
                       "input_image": input_image, "mu": mu})
        out = self.generate(values, cfg_scale=cfg_scale, num_inference_steps=num_inference_steps,
                            denoising_strength=denoising_strength, progress=progress, output_type=output_type)
        return out[0] if isinstance(prompt, str) and output_type == "pil" else out


__all__ = ["CALL_DEFAULTS", "Krea2Pipeline"]
