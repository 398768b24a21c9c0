"""Wan2.2-Animate-2's pipeline class."""

from __future__ import annotations

import torch

from ....core.checkpointing import set_gradient_checkpointing
from ....errors import UserError
from ....media.image import as_image_list
from ..pipeline import WanBasePipeline
from ..units import WanPromptEmbedder, WanShapeChecker
from .keys import ANIMATE2_LORA_TARGETS, animate2_module_name
from .model import animate2_forward
from .units import (ANIMATE2, ANIMATE2_COLUMNS, DEFAULT_PROMPT_REF, WanAnimate2CLIPEmbedder, WanAnimate2Guidance,
                    WanAnimate2InputVideoEmbedder, WanAnimate2NoiseInitializer, WanAnimate2PromptEmbedder,
                    WanAnimate2VAEEmbedder)


class WanAnimate2Pipeline(WanBasePipeline):
    """Wan2.2-Animate-2-14B (and -Distilled): its own transformer and model_fn (a reference pass, then the clip's),
    one leading latent frame (the reference image's) that sampling drops. A run is its own when its DiT is a
    WanAnimate2Transformer3DModel or its data has the animate2_* columns (the reference's stage 1 names no DiT)."""

    model_names = ("dit", "text_encoder", "vae", "image_encoder")
    features = (ANIMATE2,)
    loss_models = ("dit",)
    lora_target_aliases = {"dit": ANIMATE2_LORA_TARGETS}
    # its DiT's modules have no Wan-AI names (blocks.N.block.*): the default LoRA file keeps diffusers' layout
    lora_default_format = "diffusers"

    def __init__(self, device="cpu", torch_dtype=torch.float32, scheduler=None):
        super().__init__(device, torch_dtype, scheduler)
        self.units = [WanShapeChecker(), WanAnimate2NoiseInitializer(), WanAnimate2InputVideoEmbedder(),
                      WanPromptEmbedder(), WanAnimate2PromptEmbedder(), WanAnimate2CLIPEmbedder(),
                      WanAnimate2VAEEmbedder(), WanAnimate2Guidance()]

    @classmethod
    def claims(cls, context) -> bool:
        dit = context.config("dit") or {}
        return dit.get("_class_name") == "WanAnimate2Transformer3DModel" or context.has(*ANIMATE2_COLUMNS)

    @classmethod
    def check_run(cls, context, features):
        if not context.has("animate2_reference_image") or not context.has("animate2_reference_video"):
            raise UserError("Wan2.2-Animate-2 trains on animate2_reference_image and animate2_reference_video: "
                            "name both in --extra_inputs")
        dit = context.config("dit")
        if dit is not None and dit.get("_class_name") != "WanAnimate2Transformer3DModel":
            raise UserError("animate2_* inputs were given but the DiT is not Wan2.2-Animate-2's")

    def module_path(self, slot: str, path: str) -> str:
        """The reference's names of this DiT's modules (`blocks.0.block.self_attn.q`) -> diffusers'."""
        return animate2_module_name(path) if slot == "dit" else path

    def negative_name(self, name: str) -> str:
        return "negative_animate2_conditional" if name == "animate2_conditional" else super().negative_name(name)

    def model_fn(self, latents, timestep, prompt_embeds, image_embeds=None, condition=None,
                 animate2_condition_latents=None, animate2_condition_y=None, animate2_prompt_embeds=None,
                 animate2_reference_image_embeds=None, animate2_conditional=None, reference_timestep=None,
                 use_gradient_checkpointing=False, use_gradient_checkpointing_offload=False, **_):
        if self.dit is None:
            raise UserError("no Wan2.2-Animate-2 DiT loaded")
        set_gradient_checkpointing(self.dit, use_gradient_checkpointing, use_gradient_checkpointing_offload)
        return animate2_forward(self.dit, latents, timestep, prompt_embeds, image_embeds, condition,
                                animate2_condition_latents, animate2_condition_y, animate2_prompt_embeds,
                                animate2_reference_image_embeds, unconditional=not animate2_conditional,
                                reference_timestep=reference_timestep)

    def sampling_settings(self, values):
        # the reference computes the reference pass's KV cache once, at the first sampling step
        return {"reference_timestep": self.scheduler.timesteps[0]}

    def finish_latents(self, latents, values):
        return latents[:, :, 1:]  # the reference image's leading frame

    def __call__(self, prompt, negative_prompt="", *, animate2_reference_image, animate2_reference_video,
                 animate2_prompt_ref: str = DEFAULT_PROMPT_REF, animate2_refert_images=None,
                 height: int | None = None, width: int | None = None, num_frames: int | None = None,
                 num_inference_steps: int = 50, cfg_scale: float = 5.0, seed: int | None = None,
                 progress: bool = True, output_type: str = "pil"):
        """A clip of `animate2_reference_image`'s character moving as in `animate2_reference_video` (frames); its
        size and length default to the reference video's. `animate2_refert_images`: the previous clip's last
        frames, to continue a long video."""
        frames = as_image_list(animate2_reference_video)
        width, height = (width or frames[0].size[0]), (height or frames[0].size[1])
        values = self.prompt_values(prompt, negative_prompt)
        values.update({"height": height, "width": width, "num_frames": num_frames or len(frames), "seed": seed,
                       "animate2_reference_image": animate2_reference_image, "animate2_reference_video": frames,
                       "animate2_prompt_ref": animate2_prompt_ref, "animate2_refert_images": animate2_refert_images})
        out = self.generate(values, cfg_scale=cfg_scale, num_inference_steps=num_inference_steps, progress=progress,
                            output_type=output_type)
        return out[0] if isinstance(prompt, str) and output_type == "pil" else out


__all__ = ["WanAnimate2Pipeline"]
