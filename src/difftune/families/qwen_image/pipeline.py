"""`QwenImagePipeline`: the reference-named pipeline of Qwen-Image and Qwen-Image-Edit (inference and the
training hooks the shared trainer calls).

Architectures come from diffusers (`QwenImageTransformer2DModel`, `AutoencoderKLQwenImage`) and
transformers (`Qwen2_5_VLForConditionalGeneration`), so official checkpoints load with their own key names.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from PIL import Image

from ...core.batch import SAME
from ...core.pipeline import BasePipeline
from ...errors import UserError
from ...media.image import as_image_list, tensor_to_images
from ...core.latents import pack_latents, unpack_latents
from .edit_plus import loaded_edit_image, per_prompt_edit_images
from .layered import (QwenImageLayerInputEmbedder, QwenImageLayerStackEmbedder, is_layered, is_layered_dit,
                      layered_training_inputs, model_fn_qwen_image_layered, sample_layered)
from .model_fn import model_fn_qwen_image
from .control_inputs import (CONTROL_DATA_INPUTS, CONTROL_MODEL_FN_INPUTS, QwenImageBlockwiseControlNetEmbedder,
                             QwenImageContextImageEmbedder, QwenImageEntityControl, check_controlnet_fed,
                             control_call_inputs, control_training_inputs)
from .components import SCHEDULER_CONFIG, TRAINING_MU
from .units import (DIVISION_FACTOR, QwenImageEditImageEmbedder, QwenImageInputImageEmbedder,
                    QwenImageNoiseInitializer, QwenImagePromptEmbedder, QwenImageShapeChecker, template_drop_count,
                    vae_decode)


class QwenImagePipeline(BasePipeline):
    family = "qwen_image"
    model_names = ("dit", "text_encoder", "vae", "blockwise_controlnet")
    batch_shared_inputs = ("height", "width", "rand_device")  # kept once in a stage-1 batch
    settings = frozenset({"rand_device", "batch_size", "edit_image_auto_resize", "use_gradient_checkpointing",
                          "use_gradient_checkpointing_offload", "zero_cond_t"})
    model_fn_settings = ("use_gradient_checkpointing", "use_gradient_checkpointing_offload", "zero_cond_t")
    model_fn_inputs = ("prompt_embeds", "prompt_embeds_mask", "edit_latents", "layer_input_latents",
                       *CONTROL_MODEL_FN_INPUTS)
    data_inputs = ("image", "prompt", "seed", "rand_device", "edit_image", "num_inference_steps", "height", "width",
                   "layer_input_image", "layer_num", *CONTROL_DATA_INPUTS)
    # direct_distill samples a whole batch in lockstep, so a batch shares its step count
    input_batching = {"num_inference_steps": SAME, "height": SAME, "width": SAME}
    loss_models = ("dit", "blockwise_controlnet")  # model_fn runs the ControlNet (when one is loaded)
    decode_models = ("vae",)
    division_factor = DIVISION_FACTOR

    patch_size = 2
    vae_scale = 8
    latent_channels = 16

    def __init__(self, device="cpu", torch_dtype=torch.float32, scheduler=None):
        super().__init__(device, torch_dtype)
        self.scheduler = scheduler or self.default_scheduler()
        self.tokenizer = None
        self.processor = None
        self._drops: dict[str, int] = {}
        self.units = [QwenImageShapeChecker(), QwenImageNoiseInitializer(), QwenImageInputImageEmbedder(),
                      QwenImageLayerStackEmbedder(), QwenImageEditImageEmbedder(), QwenImageLayerInputEmbedder(),
                      QwenImageContextImageEmbedder(), QwenImageBlockwiseControlNetEmbedder(),
                      QwenImageEntityControl(), QwenImagePromptEmbedder()]

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
    def model_fn(self, latents, timestep, prompt_embeds, prompt_embeds_mask=None, edit_latents=None,
                 layer_input_latents=None, **settings):
        if latents.dim() == 5 or is_layered_dit(self.dit):  # Qwen-Image-Layered: a stack of layers
            return model_fn_qwen_image_layered(self.dit, latents, timestep, prompt_embeds, prompt_embeds_mask,
                                               layer_input_latents, edit_latents=edit_latents, **settings)
        controlnet = self.models.get("blockwise_controlnet")
        check_controlnet_fed(controlnet, settings.get("blockwise_controlnet_conditioning"))
        return model_fn_qwen_image(self.dit, latents, timestep, prompt_embeds, prompt_embeds_mask, edit_latents,
                                   blockwise_controlnet=controlnet, **settings)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return vae_decode(self, latents)

    def combine_cfg(self, posi, nega, cfg_scale):
        if posi.dim() == 5:  # Qwen-Image-Layered's guidance is plain (diffusers' cfg_normalize=False)
            return super().combine_cfg(posi, nega, cfg_scale)
        # Qwen-Image's true CFG keeps the norm of the conditional prediction per 2x2 patch token.
        comb = nega + cfg_scale * (posi - nega)
        h, w = posi.shape[-2:]
        p, c = pack_latents(posi), pack_latents(comb)
        scale = p.norm(dim=-1, keepdim=True) / c.norm(dim=-1, keepdim=True)
        return unpack_latents(c * scale, h, w)

    # -- training -------------------------------------------------------------------------------------
    def training_inputs(self, data: dict[str, Any]) -> dict[str, Any]:
        """Pipeline inputs for one data sample, as inference would be called (batch of one)."""
        if is_layered(data):
            return layered_training_inputs(self, data, QwenImagePipeline.training_inputs)
        image = data.get("image")
        if image is not None and not isinstance(image, Image.Image):
            raise UserError(f"row {data.get('_row', '?')}: 'image' must be an image file listed in --data_file_keys")
        values = {
            "prompt": data.get("prompt", ""), "negative_prompt": "", "input_image": image,
            "height": image.size[1] if image is not None else data.get("height"),
            "width": image.size[0] if image is not None else data.get("width"),
            "seed": data.get("seed"), "rand_device": data.get("rand_device", "cpu"), "batch_size": 1,
            "edit_image": loaded_edit_image(data.get("edit_image")),
            "num_inference_steps": data.get("num_inference_steps"),
            **control_training_inputs(data),
        }
        if values["prompt"] is None or (isinstance(values["prompt"], float) and math.isnan(values["prompt"])):
            values["prompt"] = ""
        return values

    @staticmethod
    def batch_signature(sample: dict[str, Any]) -> tuple:
        """Samples with equal signatures can be encoded in one batch (Qwen-Image-Layered's stacks: one at a time)."""
        if is_layered(sample):
            return None
        def size(v):
            # a list (Edit-Plus) never shares a batch with one image (Edit), even of the same size
            return v.size if isinstance(v, Image.Image) else \
                tuple(getattr(i, "size", i) for i in v) if isinstance(v, list) else v

        return (size(sample.get("image")), size(loaded_edit_image(sample.get("edit_image"))),
                sample.get("rand_device", "cpu"))

    def training_inputs_batch(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        values = super().training_inputs_batch(samples)
        if len(samples) == 1 and isinstance(values.get("edit_image"), list):
            values["edit_image"] = [values["edit_image"]]  # the sample axis, so one image's list stays a list
        return values

    # -- inference ------------------------------------------------------------------------------------
    @torch.no_grad()
    def __call__(self, prompt: str | list[str], negative_prompt: str | list[str] = "", cfg_scale: float = 4.0,
                 height: int | None = 1328, width: int | None = 1328, num_inference_steps: int = 30,
                 seed: int | None = None, input_image=None, denoising_strength: float = 1.0, edit_image=None,
                 edit_image_auto_resize: bool = True, rand_device: str = "cpu", progress: bool = True,
                 output_type: str = "pil", zero_cond_t: bool = False, context_image=None,
                 eligen_entity_prompts=None, eligen_entity_masks=None, eligen_enable_on_negative: bool = False,
                 blockwise_controlnet_image=None, blockwise_controlnet_inpaint_mask=None,
                 blockwise_controlnet_inputs=None, layer_input_image=None, layer_num=None):
        if layer_input_image is not None or layer_num is not None:
            if any(v is not None for v in (eligen_entity_prompts, eligen_entity_masks, blockwise_controlnet_image,
                                           blockwise_controlnet_inputs)):
                raise UserError("Qwen-Image-Layered sampling takes context_image, not EliGen or ControlNet inputs")
            return sample_layered(self, prompt, negative_prompt, cfg_scale, height, width, num_inference_steps, seed,
                                  layer_input_image, layer_num, rand_device, progress, output_type,
                                  context_image=context_image)
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        negatives = [negative_prompt] * len(prompts) if isinstance(negative_prompt, str) else list(negative_prompt)
        if input_image is not None and (height is None or width is None):
            width, height = as_image_list(input_image)[0].size
        values: dict[str, Any] = {
            "prompt": prompts, "negative_prompt": negatives, "height": height, "width": width, "seed": seed,
            "rand_device": rand_device, "batch_size": len(prompts), "input_image": input_image,
            "edit_image": per_prompt_edit_images(edit_image, len(prompts)),
            "edit_image_auto_resize": edit_image_auto_resize,
            **control_call_inputs(len(prompts), negatives, context_image, eligen_entity_prompts, eligen_entity_masks,
                                  eligen_enable_on_negative, blockwise_controlnet_image,
                                  blockwise_controlnet_inpaint_mask, blockwise_controlnet_inputs),
        }
        self.scheduler.set_timesteps(num_inference_steps, denoising_strength=denoising_strength,
                                     image_seq_len=(-(-height // DIVISION_FACTOR)) * (-(-width // DIVISION_FACTOR)))
        self.run_units(values, cfg=cfg_scale != 1.0)
        latents = self.denoise(values, cfg_scale=cfg_scale, progress=progress, settings={"zero_cond_t": zero_cond_t})
        if output_type == "latent":  # before decoding: the caller wants no image
            return latents
        images = vae_decode(self, latents)
        if output_type == "pt":
            return (images.float() / 2 + 0.5).clamp(0, 1)
        pil = tensor_to_images(images)
        return pil[0] if isinstance(prompt, str) else pil
