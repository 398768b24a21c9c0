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
from ...core.features import Feature
from ...core.latents import pack_latents, unpack_latents
from ...core.pipeline import BasePipeline
from ...errors import UserError
from ...media.image import as_image_list
from .components import SCHEDULER_CONFIG, TRAINING_MU
from .context import QwenImageContextImageEmbedder
from .control_inputs import check_controlnet_fed, control_call_inputs, control_training_inputs
from .controlnet import QwenImageBlockwiseControlNetEmbedder
from .edit_plus import loaded_edit_image, per_prompt_edit_images
from .eligen import ENTITY_OUTPUTS, QwenImageEntityControl
from .model_fn import model_fn_qwen_image
from .prompt import QwenImageEditPromptEmbedder
from .units import (DIVISION_FACTOR, QwenImageEditImageEmbedder, QwenImageInputImageEmbedder,
                    QwenImageNoiseInitializer, QwenImagePromptEmbedder, QwenImageShapeChecker, template_drop_count,
                    vae_decode)

# The family's sampling defaults (the official pipeline's): one place, read by __call__, `difftune sample` and
# validation.
CALL_DEFAULTS = {"height": 1328, "width": 1328, "num_inference_steps": 30, "cfg_scale": 4.0}

EDIT = Feature("edit", columns=("edit_image",), model_fn_inputs=("edit_latents",),
               description="Qwen-Image-Edit / Edit-Plus: edit image(s) shown to the text encoder and the DiT")
CONTEXT = Feature("context", columns=("context_image",), model_fn_inputs=("context_latents",),
                  description="In-Context control: a control image's tokens beside the image's")
BLOCKWISE_CONTROLNET = Feature(
    "blockwise_controlnet", columns=("blockwise_controlnet_image",),
    model_fn_inputs=("blockwise_controlnet_conditioning",),
    data_inputs=("blockwise_controlnet_image", "blockwise_controlnet_inpaint_mask"),
    description="Blockwise ControlNet: a control image's residuals after each DiT block")
ELIGEN = Feature("eligen", columns=("eligen_entity_prompts", "eligen_entity_masks"), model_fn_inputs=ENTITY_OUTPUTS,
                 same_length=(("eligen_entity_prompts", "eligen_entity_masks"),),
                 description="EliGen: entity prompts with regional attention masks")


class QwenImagePipeline(BasePipeline):
    model_names = ("dit", "text_encoder", "vae", "blockwise_controlnet")
    batch_shared_inputs = ("height", "width", "rand_device")  # kept once in a stage-1 batch
    settings = frozenset({"rand_device", "batch_size", "edit_image_auto_resize", "use_gradient_checkpointing",
                          "use_gradient_checkpointing_offload", "zero_cond_t"})
    model_fn_settings = ("use_gradient_checkpointing", "use_gradient_checkpointing_offload", "zero_cond_t")
    model_fn_inputs = ("prompt_embeds", "prompt_embeds_mask")
    padding_masks = ("prompt_embeds_mask",)
    features = (EDIT, CONTEXT, BLOCKWISE_CONTROLNET, ELIGEN)
    data_inputs = ("image", "prompt", "seed", "rand_device", "num_inference_steps", "height", "width")
    # direct_distill samples a whole batch in lockstep, so a batch shares its step count
    input_batching = {"num_inference_steps": SAME, "height": SAME, "width": SAME}
    loss_models = ("dit", "blockwise_controlnet")  # model_fn runs the ControlNet (when one is loaded)
    decode_models = ("vae",)
    division_factor = DIVISION_FACTOR
    call_defaults = CALL_DEFAULTS

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
                      QwenImageEditImageEmbedder(), QwenImageContextImageEmbedder(),
                      QwenImageBlockwiseControlNetEmbedder(), QwenImageEntityControl(), QwenImagePromptEmbedder(),
                      QwenImageEditPromptEmbedder()]

    @staticmethod
    def default_scheduler():
        """The official scheduler config; training draws from the reference's table at mu = 0.8."""
        from ...schedulers import FlowMatchScheduler

        return FlowMatchScheduler(training_mu=TRAINING_MU, **SCHEDULER_CONFIG)

    @classmethod
    def data_operators(cls, config) -> dict:
        """EliGen masks are cropped as the training image is (a mask of the image's size stays aligned with it), and
        one too small for the size factor is kept whole: the unit resizes every mask to the latent grid."""
        from ...data import IMAGE_EXTENSIONS, ImageCropAndResize, LoadImage, RouteByExtension, ToAbsolutePath

        f = cls.division_factor
        height, width = ((None, None) if config.height is None or config.width is None else
                         (-(-config.height // f) * f, -(-config.width // f) * f))
        return {"eligen_entity_masks": ToAbsolutePath(config.dataset_base_path)
                >> RouteByExtension({IMAGE_EXTENSIONS: LoadImage()})
                >> ImageCropAndResize(height, width, config.max_pixels, f, f, keep_small=True)}

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
    def model_fn(self, latents, timestep, prompt_embeds, prompt_embeds_mask=None, edit_latents=None, **settings):
        if latents.dim() == 5:
            raise UserError("a stack of layers needs Qwen-Image-Layered's weights (its transformer and RGBA VAE)")
        controlnet = self.models.get("blockwise_controlnet")
        check_controlnet_fed(controlnet, settings.get("blockwise_controlnet_conditioning"))
        return model_fn_qwen_image(self.dit, latents, timestep, prompt_embeds, prompt_embeds_mask, edit_latents,
                                   blockwise_controlnet=controlnet, **settings)

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        return vae_decode(self, latents)

    def combine_cfg(self, posi, nega, cfg_scale):
        # Qwen-Image's true CFG keeps the norm of the conditional prediction per 2x2 patch token.
        comb = nega + cfg_scale * (posi - nega)
        h, w = posi.shape[-2:]
        p, c = pack_latents(posi), pack_latents(comb)
        scale = p.norm(dim=-1, keepdim=True) / c.norm(dim=-1, keepdim=True)
        return unpack_latents(c * scale, h, w)

    # -- training -------------------------------------------------------------------------------------
    def training_inputs(self, data: dict[str, Any]) -> dict[str, Any]:
        """Pipeline inputs for one data sample, as inference would be called (batch of one)."""
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
            "edit_image": loaded_edit_image(data.get("edit_image")),
            **control_training_inputs(data),
        }
        if values["prompt"] is None or (isinstance(values["prompt"], float) and math.isnan(values["prompt"])):
            values["prompt"] = ""
        return values

    @staticmethod
    def batch_signature(sample: dict[str, Any]) -> tuple:
        """Samples with equal signatures can be encoded in one batch."""
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
    def __call__(self, prompt: str | list[str], negative_prompt: str | list[str] = "",
                 cfg_scale: float = CALL_DEFAULTS["cfg_scale"], height: int | None = CALL_DEFAULTS["height"],
                 width: int | None = CALL_DEFAULTS["width"],
                 num_inference_steps: int = CALL_DEFAULTS["num_inference_steps"], seed: int | None = None,
                 input_image=None, denoising_strength: float = 1.0, edit_image=None,
                 edit_image_auto_resize: bool = True, rand_device: str = "cpu", progress: bool = True,
                 output_type: str = "pil", zero_cond_t: bool = False, context_image=None,
                 eligen_entity_prompts=None, eligen_entity_masks=None, eligen_enable_on_negative: bool = False,
                 blockwise_controlnet_image=None, blockwise_controlnet_inpaint_mask=None,
                 blockwise_controlnet_inputs=None):
        values = self.prompt_values(prompt, negative_prompt)
        if input_image is not None and (height is None or width is None):
            width, height = as_image_list(input_image)[0].size
        n = values["batch_size"]
        values.update({
            "height": height, "width": width, "seed": seed, "rand_device": rand_device, "input_image": input_image,
            "edit_image": per_prompt_edit_images(edit_image, n), "edit_image_auto_resize": edit_image_auto_resize,
            **control_call_inputs(n, values["negative_prompt"], context_image, eligen_entity_prompts,
                                  eligen_entity_masks, eligen_enable_on_negative, blockwise_controlnet_image,
                                  blockwise_controlnet_inpaint_mask, blockwise_controlnet_inputs),
        })
        out = self.generate(values, cfg_scale=cfg_scale, num_inference_steps=num_inference_steps,
                            denoising_strength=denoising_strength, settings={"zero_cond_t": zero_cond_t},
                            progress=progress, output_type=output_type)
        return out[0] if isinstance(prompt, str) and output_type == "pil" else out


def _row(data) -> str:
    row = data.get("_row")
    return str(row + 1) if isinstance(row, int) else "?"
