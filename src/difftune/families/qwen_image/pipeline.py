"""`QwenImagePipeline`: the reference-named pipeline of Qwen-Image and its features (Edit and Edit-Plus, In-Context
control, Blockwise ControlNet, EliGen): inference and the training hooks the shared trainer calls.

The row, the call and the stage-1 batches are the base pipeline's, from its target (images: a row's list of layers is
refused, it is Qwen-Image-Layered's) and features (the call's inputs by the reference's names: `call_inputs()`).

Architectures come from diffusers (`QwenImageTransformer2DModel`, `AutoencoderKLQwenImage`) and transformers
(`Qwen2_5_VLForConditionalGeneration`), so official checkpoints load with their own key names. Qwen-Image-Layered,
which changes the latent layout and sampling, is its own class (layered.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from PIL import Image

from ...core.batch import SAME
from ...core.latents import pack_latents, unpack_latents
from ...core.pipeline import BasePipeline
from ...core.target import ImageStream, Target
from ...errors import UserError, row_label
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


@dataclass(frozen=True, eq=False)
class QwenImageStream(ImageStream):
    """Qwen-Image's images; a row whose `image` is a list (a stack of layers) is Qwen-Image-Layered's."""

    def row_value(self, data):
        if isinstance(data.get(self.column), list):
            raise UserError(f"{row_label(data)}: 'image' is a list of layers, which needs Qwen-Image-Layered's "
                            f"weights (its transformer and RGBA VAE)")
        return super().row_value(data)

    def signature(self, value):
        return sizes(value)


class QwenImageBasePipeline(BasePipeline):
    """Qwen-Image's models, units, denoiser call and guidance, with no feature: a pipeline class lists its features
    (`QwenImagePipeline`, `QwenImageLayeredPipeline`), which add their slots, units, columns and call inputs."""

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
    # a sampling call's zero_cond_t (Edit-2511) reaches the denoiser call as a setting (one of `model_fn_settings`)
    call_parameters = {"zero_cond_t": False}
    target = Target((QwenImageStream(channels=16, scale=8, patch=2, division=DIVISION_FACTOR, decoder=vae_decode),))
    # the official scheduler config; training draws from the reference's table at mu = 0.8
    scheduler_config = SCHEDULER_CONFIG
    training_mu = TRAINING_MU
    base_units = (QwenImageShapeChecker, QwenImageNoiseInitializer, QwenImageInputImageEmbedder,
                  QwenImagePromptEmbedder)

    def __init__(self, device="cpu", torch_dtype=torch.float32, scheduler=None):
        super().__init__(device, torch_dtype, scheduler)
        self.tokenizer = self.processor = None
        self._drops: dict[str, int] = {}

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

    # -- inference ------------------------------------------------------------------------------------
    def feature_values(self, inputs: dict[str, Any], values: dict[str, Any]) -> dict[str, Any]:
        """A call's feature inputs (the reference's names) as values for its prompts; an unknown name is a
        TypeError naming the known ones (Qwen-Image-Layered's `__call__`)."""
        given, _ = self.take_call_inputs(inputs)
        out = {}
        for feature in self.features:
            out.update(feature.call_values(given, values)[0])
        return out


class QwenImagePipeline(QwenImageBasePipeline):
    """Qwen-Image text-to-image with the features that add to the same algorithm (each its own module, chosen per
    run from its data columns and models)."""

    features = (EDIT, CONTEXT, BLOCKWISE, ELIGEN)


__all__ = ["CALL_DEFAULTS", "QwenImageBasePipeline", "QwenImagePipeline"]
