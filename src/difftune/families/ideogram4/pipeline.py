"""`Ideogram4Pipeline`: Ideogram-4 text-to-image (and image-to-image), inference and the training hooks.

Guidance is Ideogram's asymmetric one: the negative side is no prompt at all, run through the unconditional DiT
(`dit_uncond`, the release's `unconditional_transformer/`) when it is loaded, else through the DiT with no text (the
reference's fallback); a negative prompt has nothing to change. `cfg_scale` s blends the two as
v = s * v_cond + (1 - s) * v_uncond (the reference's, and diffusers' `guidance_scale`).
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
from .model_fn import model_fn_ideogram4
from .scheduler import Ideogram4Scheduler
from .units import DIVISION_FACTOR, TOKEN_CHANNELS, Ideogram4InputImageEmbedder, Ideogram4NoiseInitializer, \
    Ideogram4PromptEmbedder, Ideogram4ShapeChecker, vae_decode

# Every sampling default of the family (the reference's: 50 steps at 1024 x 1024, cfg 7).
CALL_DEFAULTS = {"height": 1024, "width": 1024, "num_inference_steps": 50, "cfg_scale": 7.0}


class Ideogram4Pipeline(BasePipeline):
    model_names = ("dit", "dit_uncond", "text_encoder", "vae")
    settings = frozenset({"batch_size", "rand_device", "use_gradient_checkpointing",
                          "use_gradient_checkpointing_offload"})
    model_fn_inputs = ("prompt_embeds", "prompt_embeds_mask")
    padding_masks = ("prompt_embeds_mask",)
    data_inputs = ("image", "prompt", "seed", "rand_device", "height", "width")
    input_batching = {"height": SAME, "width": SAME, "rand_device": SAME}
    batch_shared_inputs = ("height", "width", "rand_device")
    loss_models = ("dit",)
    call_defaults = CALL_DEFAULTS
    target = Target((ImageStream(channels=TOKEN_CHANNELS, scale=DIVISION_FACTOR, patch=1,
                                 division=DIVISION_FACTOR, decoder=vae_decode),))

    def __init__(self, device="cpu", torch_dtype=torch.float32, scheduler=None):
        super().__init__(device, torch_dtype)
        self.scheduler = scheduler or Ideogram4Scheduler()
        self.tokenizer = None
        self.units = [Ideogram4ShapeChecker(), Ideogram4PromptEmbedder(), Ideogram4NoiseInitializer(),
                      Ideogram4InputImageEmbedder()]

    @staticmethod
    def default_scheduler():
        return Ideogram4Scheduler()

    # -- model_fn -------------------------------------------------------------------------------------
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

    # -- training -------------------------------------------------------------------------------------
    def training_inputs(self, data: dict[str, Any]) -> dict[str, Any]:
        row = data.get("_row", "?")
        image = data.get("image")
        if not isinstance(image, Image.Image):
            raise UserError(f"row {row}: 'image' must be an image file listed in --data_file_keys")
        prompt = data.get("prompt", "")
        if prompt is None or (isinstance(prompt, float) and math.isnan(prompt)):
            prompt = ""
        return {"prompt": prompt, "input_image": image, "height": image.size[1], "width": image.size[0],
                "seed": data.get("seed"), "rand_device": data.get("rand_device") or "cpu", "batch_size": 1}

    def batch_signature(self, sample: dict[str, Any]) -> tuple:
        image = sample.get("image")
        return (image.size if isinstance(image, Image.Image) else None, sample.get("rand_device") or "cpu")

    # -- inference ------------------------------------------------------------------------------------
    def __call__(self, prompt: str | list[str], negative_prompt: str | list[str] = "",
                 cfg_scale: float = CALL_DEFAULTS["cfg_scale"], height: int | None = CALL_DEFAULTS["height"],
                 width: int | None = CALL_DEFAULTS["width"],
                 num_inference_steps: int = CALL_DEFAULTS["num_inference_steps"], seed: int | None = None,
                 input_image=None, denoising_strength: float = 1.0, rand_device: str = "cpu", progress: bool = True,
                 output_type: str = "pil", **inputs):
        """`negative_prompt` is accepted as the reference's and changes nothing (see the module's docstring)."""
        self.take_call_inputs(inputs)
        values = self.prompt_values(prompt, negative_prompt)
        if input_image is not None and (height is None or width is None):
            width, height = as_image_list(input_image)[0].size
        values.update({"height": height, "width": width, "seed": seed, "rand_device": rand_device,
                       "input_image": input_image})
        out = self.generate(values, cfg_scale=cfg_scale, num_inference_steps=num_inference_steps,
                            denoising_strength=denoising_strength, progress=progress, output_type=output_type)
        return out[0] if isinstance(prompt, str) and output_type == "pil" else out


__all__ = ["CALL_DEFAULTS", "Ideogram4Pipeline"]
