"""`QwenImagePipeline`: the reference-named pipeline of Qwen-Image and its features (Edit and Edit-Plus, In-Context
control, Blockwise ControlNet, EliGen): inference and the training hooks the shared trainer calls.

Architectures come from diffusers (`QwenImageTransformer2DModel`, `AutoencoderKLQwenImage`) and transformers
(`Qwen2_5_VLForConditionalGeneration`), so official checkpoints load with their own key names. Qwen-Image-Layered,
which changes the latent layout and sampling, is its own class (layered.py).
"""

from __future__ import annotations

import math
from typing import Any

import torch
from PIL import Image

from ...core.batch import SAME
from ...core.latents import pack_latents, unpack_latents
from ...core.pipeline import BasePipeline
from ...core.target import ImageStream, Target
from ...errors import UserError
from ...media.image import as_image_list
from .components import SCHEDULER_CONFIG, TRAINING_MU
from .context import CONTEXT
from .controlnet import BLOCKWISE
from .edit_plus import EDIT
from .eligen import ELIGEN
from .feature import sizes
from .model_fn import model_fn_qwen_image
from .units import (DIVISION_FACTOR, QwenImageInputImageEmbedder, QwenImageNoiseInitializer, QwenImagePromptEmbedder,
                    QwenImageShapeChecker, template_drop_count, vae_decode)

# The family's sampling defaults (the official pipeline's): one place, read by __call__, `difftune sample` and
# validation.
CALL_DEFAULTS = {"height": 1328, "width": 1328, "num_inference_steps": 30, "cfg_scale": 4.0}


class QwenImageBasePipeline(BasePipeline):
    """Qwen-Image's models, units, denoiser call, training hooks and `__call__`, with no feature: a pipeline class
    lists its features (`QwenImagePipeline`, `QwenImageLayeredPipeline`), which add their slots, units, columns and
    call inputs."""

    model_names = ("dit", "text_encoder", "vae")
    batch_shared_inputs = ("height", "width", "rand_device")  # kept once in a stage-1 batch
    settings = frozenset({"rand_device", "batch_size", "edit_image_auto_resize", "use_gradient_checkpointing",
                          "use_gradient_checkpointing_offload", "zero_cond_t"})
    model_fn_settings = ("use_gradient_checkpointing", "use_gradient_checkpointing_offload", "zero_cond_t")
    model_fn_inputs = ("prompt_embeds", "prompt_embeds_mask")
    padding_masks = ("prompt_embeds_mask",)
    data_inputs = ("image", "prompt", "seed", "rand_device", "num_inference_steps", "height", "width")
    # direct_distill samples a whole batch in lockstep, so a batch shares its step count
    input_batching = {"num_inference_steps": SAME, "height": SAME, "width": SAME}
    loss_models = ("dit",)
    call_defaults = CALL_DEFAULTS
    target = Target((ImageStream(channels=16, scale=8, patch=2, division=DIVISION_FACTOR, decoder=vae_decode),))


    def __init__(self, device="cpu", torch_dtype=torch.float32, scheduler=None):
        super().__init__(device, torch_dtype)
        self.scheduler = scheduler or self.default_scheduler()
        self.tokenizer = None
        self.processor = None
        self._drops: dict[str, int] = {}
        self.units = [QwenImageShapeChecker(), QwenImageNoiseInitializer(), QwenImageInputImageEmbedder(),
                      QwenImagePromptEmbedder()]

    @staticmethod
    def default_scheduler():
        """The official scheduler config; training draws from the reference's table at mu = 0.8."""
        from ...schedulers import FlowMatchScheduler

        return FlowMatchScheduler(training_mu=TRAINING_MU, **SCHEDULER_CONFIG)

    def template_drop(self, template: str) -> int:
        if template not in self._drops:
            if self.tokenizer is None:
                raise UserError("no tokenizer: pass --tokenizer_path (or tokenizer_config) to encode prompts")
            self._drops[template] = template_drop_count(self.tokenizer, template)
        return self._drops[template]

    def vl_inputs(self, texts: list[str], images: list[Image.Image]):
        """Tokens and pixel inputs for Qwen2.5-VL with one image per text (what Qwen2VLProcessor does)."""
        if self.processor is None:
            raise UserError("editing needs the image processor: pass --processor_path (the model's processor/ folder)")
        image_processor = self.processor
        vis = image_processor(images=images, return_tensors="pt")
        merge = getattr(image_processor, "merge_size", 2) ** 2
        counts = (vis["image_grid_thw"].prod(-1) // merge).tolist()
        if len(images) == 1 and len(texts) > 1:
            counts = counts * len(texts)
            vis = {"pixel_values": vis["pixel_values"].repeat(len(texts), 1),
                   "image_grid_thw": vis["image_grid_thw"].repeat(len(texts), 1)}
        expanded = [t.replace("<|image_pad|>", "<|image_pad|>" * int(n), 1) for t, n in zip(texts, counts)]
        tokens = self.tokenizer(expanded, padding=True, return_tensors="pt")
        return {"input_ids": tokens["input_ids"], "attention_mask": tokens["attention_mask"]}, dict(vis)

    # -- model_fn -------------------------------------------------------------------------------------
    def model_fn(self, latents, timestep, prompt_embeds, prompt_embeds_mask=None, **inputs):
        if latents.dim() == 5:
            raise UserError("a stack of layers needs Qwen-Image-Layered's weights (its transformer and RGBA VAE)")
        return model_fn_qwen_image(self.dit, latents, timestep, prompt_embeds, prompt_embeds_mask, pipe=self,
                                   features=self.features, **inputs)

    def combine_cfg(self, posi, nega, cfg_scale):
        # Qwen-Image's true CFG keeps the norm of the conditional prediction per 2x2 patch token.
        comb = nega + cfg_scale * (posi - nega)
        h, w = posi.shape[-2:]
        p, c = pack_latents(posi), pack_latents(comb)
        scale = p.norm(dim=-1, keepdim=True) / c.norm(dim=-1, keepdim=True)
        return unpack_latents(c * scale, h, w)

    # -- training -------------------------------------------------------------------------------------
    def training_inputs(self, data: dict[str, Any]) -> dict[str, Any]:
        """Pipeline inputs for one data sample, as inference would be called (batch of one); the features' columns
        as each feature reads them (`row_values`)."""
        image = data.get("image")
        if isinstance(image, list):
            raise UserError(f"row {_row(data)}: 'image' is a list of layers, which needs Qwen-Image-Layered's weights "
                            f"(its transformer and RGBA VAE)")
        if image is not None and not isinstance(image, Image.Image):
            raise UserError(f"row {data.get('_row', '?')}: 'image' must be an image file listed in --data_file_keys")
        values = {
            "prompt": data.get("prompt", ""), "negative_prompt": "", "input_image": image,
            "height": image.size[1] if image is not None else data.get("height"),
            "width": image.size[0] if image is not None else data.get("width"),
            "seed": data.get("seed"), "rand_device": data.get("rand_device", "cpu"), "batch_size": 1,
            "num_inference_steps": data.get("num_inference_steps"),
        }
        for feature in self.features:
            values.update(feature.row_values(data))
        if values["prompt"] is None or (isinstance(values["prompt"], float) and math.isnan(values["prompt"])):
            values["prompt"] = ""
        return values

    def batch_signature(self, sample: dict[str, Any]) -> tuple:
        """Samples with equal signatures can be encoded in one batch."""
        parts = [part for feature in self.features for part in feature.signature(sample)]
        return (sizes(sample.get("image")), *parts, sample.get("rand_device", "cpu"))

    def training_inputs_batch(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        values = super().training_inputs_batch(samples)
        for feature in self.features:
            feature.batch_values(values, len(samples))
        return values

    # -- inference ------------------------------------------------------------------------------------
    def feature_values(self, inputs: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
        """A call's feature inputs (the reference's names) as values for its prompts; an unknown name is a
        TypeError naming the known ones."""
        given, _ = self.take_call_inputs(inputs)
        out = {}
        for feature in self.features:
            out.update(feature.call_values(given, values))
        return out

    def __call__(self, prompt: str | list[str], negative_prompt: str | list[str] = "",
                 cfg_scale: float = CALL_DEFAULTS["cfg_scale"], height: int | None = CALL_DEFAULTS["height"],
                 width: int | None = CALL_DEFAULTS["width"],
                 num_inference_steps: int = CALL_DEFAULTS["num_inference_steps"], seed: int | None = None,
                 input_image=None, denoising_strength: float = 1.0, rand_device: str = "cpu", progress: bool = True,
                 output_type: str = "pil", zero_cond_t: bool = False, **inputs):
        """`inputs`: the features' inputs by the reference's names (`call_inputs()` lists them; each feature's module
        says what it takes): Edit / Edit-Plus, In-Context control, the Blockwise ControlNet, EliGen."""
        values = self.prompt_values(prompt, negative_prompt)
        values.update(self.feature_values(inputs, values))
        if input_image is not None and (height is None or width is None):
            width, height = as_image_list(input_image)[0].size
        values.update({"height": height, "width": width, "seed": seed, "rand_device": rand_device,
                       "input_image": input_image})
        out = self.generate(values, cfg_scale=cfg_scale, num_inference_steps=num_inference_steps,
                            denoising_strength=denoising_strength, settings={"zero_cond_t": zero_cond_t},
                            progress=progress, output_type=output_type)
        return out[0] if isinstance(prompt, str) and output_type == "pil" else out


class QwenImagePipeline(QwenImageBasePipeline):
    """Qwen-Image text-to-image with the features that add to the same algorithm (each its own module, chosen per
    run from its data columns and models)."""

    features = (EDIT, CONTEXT, BLOCKWISE, ELIGEN)


def _row(data) -> str:
    row = data.get("_row")
    return str(row + 1) if isinstance(row, int) else "?"


__all__ = ["CALL_DEFAULTS", "QwenImageBasePipeline", "QwenImagePipeline"]
