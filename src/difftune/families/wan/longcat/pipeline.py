"""LongCat-Video's pipeline class."""

from __future__ import annotations

import torch

from ....errors import UserError
from ..units import WanInputVideoEmbedder, WanNoiseInitializer, WanPromptEmbedder, WanShapeChecker
from ..variant import WanVariantPipeline
from .model import model_fn_longcat
from .units import LONGCAT, LongCatVideoEmbedder, is_longcat


class WanLongCatPipeline(WanVariantPipeline):
    """LongCat-Video on Wan2.1's VAE and UMT5: `model_fn_longcat` (its DiT's velocity negated). Its runs: its DiT,
    or a longcat_video column."""

    features = (LONGCAT,)
    own_inputs = ("longcat_video",)
    # the scripts name LongCat's own modules (attn.qkv, ffn.w1, ...); diffusers' Wan names (the family's default
    # targets) reach the same layers here
    lora_target_aliases = {"dit": {"to_q": "attn.qkv,cross_attn.q_linear", "to_k": "cross_attn.kv_linear",
                                   "to_v": "cross_attn.kv_linear", "to_out.0": "attn.proj,cross_attn.proj",
                                   "ffn.net.0.proj": "ffn.w1,ffn.w3", "ffn.net.2": "ffn.w2"}}

    def __init__(self, device="cpu", torch_dtype=torch.float32, scheduler=None):
        super().__init__(device, torch_dtype, scheduler)
        self.units = [WanShapeChecker(), WanNoiseInitializer(), WanInputVideoEmbedder(), WanPromptEmbedder(),
                      LongCatVideoEmbedder()]

    @classmethod
    def claims(cls, context) -> bool:
        return is_longcat(context) or context.has("longcat_video")

    @classmethod
    def check_run(cls, context, features):
        if context.config("dit") is not None and not is_longcat(context):
            raise UserError("longcat_video is LongCat-Video's input: its DiT (meituan-longcat/LongCat-Video dit/) "
                            "is not among the models")

    def model_fn(self, latents, timestep, prompt_embeds, longcat_latents=None, **settings):
        return model_fn_longcat(self.dit, latents, timestep, prompt_embeds, longcat_latents, **settings)


__all__ = ["WanLongCatPipeline"]
