"""Wan2.2-S2V's pipeline class."""

from __future__ import annotations

import torch

from ....errors import UserError
from ..units import WanInputVideoEmbedder, WanNoiseInitializer, WanPromptEmbedder, WanShapeChecker
from ..variant import WanVariantPipeline, dit_class
from .model import model_fn_wan_s2v
from .units import AUDIO_RATE, S2V, S2V_MIN_AUDIO_SECONDS, S2V_UNITS

class WanS2VPipeline(WanVariantPipeline):
    """Wan2.2-S2V-14B: speech (and a pose clip) to video behind a reference image, with its own DiT
    (`WanModel_S2V`) and wav2vec2 audio encoder; `model_fn_wan_s2v`. Its runs: its DiT, a wav2vec2 encoder, or
    the S2V data columns."""

    model_names = (*WanVariantPipeline.model_names, "audio_encoder")
    features = (S2V,)
    own_inputs = ("input_audio", "s2v_pose_video")
    # the DiT is in Wan's own module names: the reference's q,k,v,o,ffn.0,ffn.2 as they are, diffusers' Wan names
    # (the family's default targets) onto them
    lora_target_aliases = {"dit": {"to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o", "ffn.net.0.proj": "ffn.0",
                                   "ffn.net.2": "ffn.2"}}

    def __init__(self, device="cpu", torch_dtype=torch.float32, scheduler=None):
        super().__init__(device, torch_dtype, scheduler)
        self.audio_processor = None
        self.units = [WanShapeChecker(), WanNoiseInitializer(), WanInputVideoEmbedder(), WanPromptEmbedder(),
                      *(cls() for cls in S2V_UNITS)]

    @classmethod
    def claims(cls, context) -> bool:
        return dit_class(context) == "WanModel_S2V" or context.config("audio_encoder") is not None \
            or context.has("input_audio", "s2v_pose_video")

    @classmethod
    def check_run(cls, context, features):
        if dit_class(context) == "WanModel_S2V" and not context.has("input_audio"):
            raise UserError("Wan2.2-S2V needs audio: give an input_audio column (--extra_inputs input_audio)")
        if context.has("input_audio") and context.config("audio_encoder") is None:
            raise UserError("input_audio needs the wav2vec2 audio encoder: add Wan2.2-S2V-14B's "
                            "wav2vec2-large-xlsr-53-english/model.safetensors to the models")

    @classmethod
    def data_operators(cls, config) -> dict:
        from ....data.audio import audio_operator

        return {"input_audio": audio_operator(config.dataset_base_path, AUDIO_RATE,
                                              min_seconds=S2V_MIN_AUDIO_SECONDS)}

    def model_fn(self, latents, timestep, prompt_embeds, audio_embeds=None, s2v_pose_latents=None,
                 first_frame_latents=None, **settings):
        return model_fn_wan_s2v(self.dit, latents, timestep, prompt_embeds, audio_embeds, s2v_pose_latents,
                                first_frame_latents, **settings)

    # the negative side of guidance hears silence: the audio features times 0, as the reference
    def negative_name(self, name: str) -> str:
        return "negative_audio_embeds" if name == "audio_embeds" else super().negative_name(name)

    def denoise(self, values, cfg_scale=1.0, progress=True, settings=None):
        if values.get("audio_embeds") is not None and values.get("negative_audio_embeds") is None:
            values["negative_audio_embeds"] = values["audio_embeds"] * 0
        return super().denoise(values, cfg_scale=cfg_scale, progress=progress, settings=settings)


__all__ = ["WanS2VPipeline"]
