"""`Flux2Pipeline`: FLUX.2-dev (Mistral-3 text encoder, embedded guidance) and FLUX.2-klein 4B / 9B and their base
models (Qwen3 text encoder, no guidance embedder): text-to-image and image-to-image, inference and the training
hooks. Which text encoder and whether the DiT embeds guidance follow from the loaded models, so one class serves all.
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
from .components import SCHEDULER_CONFIG, TRAINING_MU
from .edit import EDIT
from .latents import LATENT_CHANNELS, VAE_SCALE, vae_decode
from .model_fn import model_fn_flux2
from .prompt import Flux2PromptEmbedder
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


class Flux2Pipeline(BasePipeline):
    model_names = ("dit", "text_encoder", "vae")
    settings = frozenset({"batch_size", "rand_device", "use_gradient_checkpointing",
                          "use_gradient_checkpointing_offload", "edit_image_auto_resize"})
    model_fn_inputs = ("prompt_embeds", "guidance")
    features = (EDIT,)  # edit.py: reference images beside the target
    sampling_values = ("guidance",)  # embedded guidance: the sampling default, not the training value
    data_inputs = ("image", "prompt", "seed", "rand_device", "num_inference_steps", "height", "width")
    input_batching = {"num_inference_steps": SAME, "height": SAME, "width": SAME, "rand_device": SAME}
    batch_shared_inputs = ("height", "width", "rand_device", "embedded_guidance")
    loss_models = ("dit",)
    call_defaults = CALL_DEFAULTS
    target = Target((ImageStream(channels=LATENT_CHANNELS, scale=VAE_SCALE, patch=1,
                                 division=DIVISION_FACTOR, decoder=vae_decode),))

    def __init__(self, device="cpu", torch_dtype=torch.float32, scheduler=None):
        super().__init__(device, torch_dtype)
        self.scheduler = scheduler or self.default_scheduler()
        self.tokenizer = None
        self.units = [Flux2ShapeChecker(), Flux2NoiseInitializer(), Flux2InputImageEmbedder(), Flux2PromptEmbedder(),
                      Flux2EmbeddedGuidance()]

    @staticmethod
    def default_scheduler():
        """FLUX.2's scheduler config; training at the reference's fixed mu of 0.8."""
        from ...schedulers import FlowMatchScheduler

        return FlowMatchScheduler(training_mu=TRAINING_MU, **SCHEDULER_CONFIG)

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
        return {
            "prompt": prompt, "negative_prompt": "", "input_image": image,
            "height": image.size[1] if image is not None else data.get("height"),
            "width": image.size[0] if image is not None else data.get("width"),
            "seed": data.get("seed"), "rand_device": data.get("rand_device") or "cpu", "batch_size": 1,
            "embedded_guidance": TRAINING_GUIDANCE, "num_inference_steps": data.get("num_inference_steps"),
            **dict.fromkeys(self.input_kinds()), **self.feature_data(data),
        }

    def batch_signature(self, sample: dict[str, Any]) -> tuple:
        def size(v):
            return v.size if isinstance(v, Image.Image) else tuple(map(size, v)) if isinstance(v, list) else v

        return (*(size(sample.get(k)) for k in ("image", *self.input_kinds())), sample.get("rand_device") or "cpu")

    # -- inference ------------------------------------------------------------------------------------
    def __call__(self, prompt: str | list[str], negative_prompt: str | list[str] = "",
                 cfg_scale: float = CALL_DEFAULTS["cfg_scale"],
                 embedded_guidance: float = CALL_DEFAULTS["embedded_guidance"],
                 height: int | None = CALL_DEFAULTS["height"], width: int | None = CALL_DEFAULTS["width"],
                 num_inference_steps: int = CALL_DEFAULTS["num_inference_steps"], seed: int | None = None,
                 input_image=None, denoising_strength: float = 1.0, rand_device: str = "cpu", progress: bool = True,
                 output_type: str = "pil", **inputs):
        """`cfg_scale` is the reference's (nega + s * (posi - nega)), which is diffusers' `guidance_scale` of the klein
        base models; `embedded_guidance` is Flux2Pipeline's `guidance_scale` (dev's distilled guidance). `inputs`:
        `edit_image` (an image or a list; edit.py) and `edit_image_auto_resize` (default True)."""
        given, settings = self.take_call_inputs(inputs)
        values = self.prompt_values(prompt, negative_prompt)
        if input_image is not None and (height is None or width is None):
            width, height = as_image_list(input_image)[0].size
        values.update({"height": height, "width": width, "seed": seed, "rand_device": rand_device,
                       "input_image": input_image, "embedded_guidance": embedded_guidance, **given})
        out = self.generate(values, cfg_scale=cfg_scale, num_inference_steps=num_inference_steps,
                            denoising_strength=denoising_strength, settings=settings, progress=progress,
                            output_type=output_type)
        return out[0] if isinstance(prompt, str) and output_type == "pil" else out


__all__ = ["CALL_DEFAULTS", "Flux2Pipeline", "compute_empirical_mu"]
