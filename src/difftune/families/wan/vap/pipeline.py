"""Video-As-Prompt's pipeline class."""

from __future__ import annotations

import torch

from ....errors import UserError
from ..pipeline import CLIP, I2V
from ..units import (WanImageEmbedderCLIP, WanImageEmbedderVAE, WanInputVideoEmbedder, WanNoiseInitializer,
                     WanPromptEmbedder, WanShapeChecker)
from ..variant import WanVariantPipeline, dit_class
from .model import model_fn_wan_vap
from .units import FEATURE, VAP_FEATURE, VAP_UNITS


class WanVAPPipeline(WanVariantPipeline):
    """Video-As-Prompt: Wan2.1 I2V-14B (conditioned on input_image as usual) with the `vap` branch reading a reference
    clip (`model_fn_wan_vap`). Its runs: the branch, its DiT file, or a vap_video column."""

    model_names = (*WanVariantPipeline.model_names, "vap")
    loss_models = ("dit", "vap")
    features = (I2V, CLIP, VAP_FEATURE)
    own_inputs = ("vap_video", "vap_prompt", "negative_vap_prompt")

    def __init__(self, device="cpu", torch_dtype=torch.float32, scheduler=None):
        super().__init__(device, torch_dtype, scheduler)
        self.units = [WanShapeChecker(), WanNoiseInitializer(), WanInputVideoEmbedder(), WanPromptEmbedder(),
                      WanImageEmbedderCLIP(), WanImageEmbedderVAE(), *(cls() for cls in VAP_UNITS)]

    @classmethod
    def claims(cls, context) -> bool:
        return context.config("vap") is not None or dit_class(context) == "WanTransformer3DMOTModel" \
            or context.has("vap_video")

    @classmethod
    def check_run(cls, context, features):
        super().check_run(context, features)
        if FEATURE not in features:
            raise UserError("Video-As-Prompt needs its reference clip: --extra_inputs vap_video (and the branch, "
                            "the transformer/ files of ByteDance/Video-As-Prompt-Wan2.1-14B)")

    def denoise(self, values, cfg_scale=1.0, progress=True, settings=None):
        # no negative reference-clip prompt (validation's renders): the positive one, as the reference's defaults
        # (" " for both) give
        if values.get("negative_context_vap") is None:
            values["negative_context_vap"] = values.get("context_vap")
        return super().denoise(values, cfg_scale=cfg_scale, progress=progress, settings=settings)

    def model_fn(self, latents, timestep, prompt_embeds, image_embeds=None, condition=None, first_frame_latents=None,
                 end_image_embeds=None, vap_hidden_state=None, vap_clip_feature=None, context_vap=None, **settings):
        settings.pop("expert_boundary", None)
        return model_fn_wan_vap(self.dit, self.vap, latents, timestep, prompt_embeds, image_embeds, condition,
                                vap_hidden_state, vap_clip_feature, context_vap, **settings)


__all__ = ["WanVAPPipeline"]
