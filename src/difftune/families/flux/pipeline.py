"""`FluxImagePipeline`: FLUX.1 text-to-image and image-to-image (inference and the training hooks).

Architectures come from diffusers (`FluxTransformer2DModel`, `AutoencoderKL`) and transformers
(`CLIPTextModel`, `T5EncoderModel`), so diffusers-layout checkpoints load with their own key names.
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
from .components import SCHEDULER_CONFIG, TRAINING_MU
from .model_fn import model_fn_flux
from .units import (DIVISION_FACTOR, FluxClipEmbedder, FluxEmbeddedGuidance, FluxInputImageEmbedder,
                    FluxKontextEmbedder, FluxNoiseInitializer, FluxShapeChecker, FluxT5Embedder, vae_decode)

TRAINING_GUIDANCE = 1.0  # the reference's embedded_guidance in training
# The family's sampling defaults (FluxPipeline's; FLUX.1-dev is guidance-distilled: cfg 1 and an embedded guidance
# of 3.5): one place, read by __call__, `difftune sample`, validation and model_fn.
CALL_DEFAULTS = {"height": 1024, "width": 1024, "num_inference_steps": 30, "cfg_scale": 1.0,
                 "embedded_guidance": 3.5}

KONTEXT = Feature("kontext", columns=("kontext_images",), model_fn_inputs=("kontext_latents", "kontext_ids"),
                  description="FLUX.1 Kontext: reference images' tokens beside the image's")


class FluxImagePipeline(BasePipeline):
    model_names = ("dit", "text_encoder", "text_encoder_2", "vae")
    batch_shared_inputs = ("height", "width", "embedded_guidance")  # kept once in a stage-1 batch
    settings = frozenset({"batch_size", "use_gradient_checkpointing", "use_gradient_checkpointing_offload"})
    model_fn_inputs = ("prompt_embeds", "pooled_prompt_embeds", "guidance")
    sampling_values = ("guidance",)  # embedded guidance: the sampling default, not the training value
    features = (KONTEXT,)
    data_inputs = ("image", "prompt", "seed", "num_inference_steps", "height", "width")
    input_batching = {"num_inference_steps": SAME, "height": SAME, "width": SAME}
    loss_models = ("dit",)
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
        self.units = [FluxShapeChecker(), FluxNoiseInitializer(), FluxInputImageEmbedder(), FluxKontextEmbedder(),
                      FluxClipEmbedder(), FluxT5Embedder(), FluxEmbeddedGuidance()]

    @staticmethod
    def default_scheduler():
        """FLUX.1-dev's scheduler config (mu from the image size, as FluxPipeline); training at the reference's
        static shift 3 (mu = ln 3)."""
        from ...schedulers import FlowMatchScheduler

        return FlowMatchScheduler(training_mu=TRAINING_MU, **SCHEDULER_CONFIG)

    def model_fn(self, latents, timestep, prompt_embeds, pooled_prompt_embeds, guidance=None, kontext_latents=None,
                 kontext_ids=None, **settings):
        return model_fn_flux(self.dit, latents, timestep, prompt_embeds, pooled_prompt_embeds, guidance,
                             kontext_latents, kontext_ids, default_guidance=self.call_defaults["embedded_guidance"],
                             **settings)

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
        kontext = data.get("kontext_images")
        if kontext is not None:
            kontext = [kontext] if isinstance(kontext, Image.Image) else kontext
            if not isinstance(kontext, list) or not kontext or \
                    not all(isinstance(k, Image.Image) for k in kontext):
                raise UserError(f"row {data.get('_row', -1) + 1}: 'kontext_images' must be image file(s) listed in "
                                f"--data_file_keys (e.g. --data_file_keys image,kontext_images), got {kontext!r:.60}")
        return {
            "prompt": prompt, "negative_prompt": "", "input_image": image, "kontext_images": kontext,
            "height": image.size[1] if image is not None else data.get("height"),
            "width": image.size[0] if image is not None else data.get("width"),
            "seed": data.get("seed"), "batch_size": 1, "embedded_guidance": TRAINING_GUIDANCE,
            "num_inference_steps": data.get("num_inference_steps"),
        }

    @staticmethod
    def batch_signature(sample: dict[str, Any]) -> tuple:
        def size(v):
            return v.size if isinstance(v, Image.Image) else tuple(map(size, v)) if isinstance(v, list) else None

        return (size(sample.get("image")), size(sample.get("kontext_images")))

    # -- inference ------------------------------------------------------------------------------------
    def __call__(self, prompt: str | list[str], negative_prompt: str | list[str] = "",
                 cfg_scale: float = CALL_DEFAULTS["cfg_scale"],
                 embedded_guidance: float = CALL_DEFAULTS["embedded_guidance"],
                 height: int | None = CALL_DEFAULTS["height"], width: int | None = CALL_DEFAULTS["width"],
                 num_inference_steps: int = CALL_DEFAULTS["num_inference_steps"], seed: int | None = None,
                 input_image=None, denoising_strength: float = 1.0, kontext_images=None, progress: bool = True,
                 output_type: str = "pil"):
        """`kontext_images` (FLUX.1 Kontext): a reference image, a list of them, or one list per prompt."""
        values = self.prompt_values(prompt, negative_prompt)
        if input_image is not None and (height is None or width is None):
            width, height = as_image_list(input_image)[0].size
        values.update({"height": height, "width": width, "seed": seed, "input_image": input_image,
                       "embedded_guidance": embedded_guidance, "kontext_images": kontext_images})
        out = self.generate(values, cfg_scale=cfg_scale, num_inference_steps=num_inference_steps,
                            denoising_strength=denoising_strength, progress=progress, output_type=output_type)
        return out[0] if isinstance(prompt, str) and output_type == "pil" else out
