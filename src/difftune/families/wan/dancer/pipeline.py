"""Wan-Dancer's pipeline class."""

from __future__ import annotations

from typing import Any

import torch

from ....core.batch import LIST, SAME
from ....errors import UserError, row_label
from ....media.image import as_image_list
from ..units import WanInputVideoEmbedder, WanNoiseInitializer, WanPromptEmbedder, WanShapeChecker, vae_decode
from ..variant import WanVariantPipeline, as_list
from .model import model_fn_wan_dancer
from .units import (DANCER, DANCER_FRAMEWISE, DANCER_UNITS, LIBROSA_MISSING, framewise_num_frames, has_librosa,
                    is_dancer)

# the reference's LoRA names on the Dancer DiT also reach the music injectors' q, k, v, o (Wan's own names there)
DANCER_LORA_ALIASES = {"q": "to_q,q", "k": "to_k,k", "v": "to_v,v", "o": "to_out.0,o", "ffn.0": "ffn.net.0.proj",
                       "ffn.2": "ffn.net.2"}


class WanDancerPipeline(WanVariantPipeline):
    """Wan-Dancer-14B (global and local models: one architecture): music, a reference image and keyframes
    (`model_fn_wan_dancer`); with a true `framewise_decoding` (the global model's keyframe clips) one latent frame per
    video frame, encoded and decoded frame by frame. Guidance's negative pass leaves block 9 out, as the
    reference's. Its runs: its DiT, or the wantodance_* columns."""

    features = (DANCER, DANCER_FRAMEWISE)
    own_inputs = ("wantodance_music_path", "wantodance_reference_image", "wantodance_fps", "wantodance_keyframes",
                      "wantodance_keyframes_mask", "framewise_decoding")
    lora_target_aliases = {"dit": DANCER_LORA_ALIASES}
    input_batching = {**WanVariantPipeline.input_batching, "wantodance_fps": SAME, "framewise_decoding": SAME,
                      "wantodance_keyframes_mask": LIST}

    def __init__(self, device="cpu", torch_dtype=torch.float32, scheduler=None):
        super().__init__(device, torch_dtype, scheduler)
        self.units = [WanShapeChecker(), WanNoiseInitializer(), WanInputVideoEmbedder(), WanPromptEmbedder(),
                      *(cls() for cls in DANCER_UNITS)]
        self.framewise = False  # how the latents of the last call decode

    @classmethod
    def claims(cls, context) -> bool:
        return is_dancer(context) or context.has("wantodance_music_path", "wantodance_keyframes",
                                                 "wantodance_reference_image")

    @classmethod
    def check_run(cls, context, features):
        if context.config("dit") is not None and not is_dancer(context):
            raise UserError("the wantodance_* inputs are Wan-Dancer's: its DiT (Wan-AI/Wan-Dancer-14B "
                            "global_model / local_model .safetensors) is not among the models")
        if context.has("wantodance_keyframes") and not context.has("wantodance_keyframes_mask"):
            raise UserError("--extra_inputs wantodance_keyframes needs wantodance_keyframes_mask too (which frames "
                            "are keyframes)")
        if context.has("wantodance_music_path") and not has_librosa():
            raise UserError(LIBROSA_MISSING)

    @classmethod
    def data_operators(cls, config) -> dict:
        from ....data.audio import audio_path_operator

        return {"wantodance_music_path": audio_path_operator(config.dataset_base_path)}

    def training_inputs(self, data: dict[str, Any]) -> dict[str, Any]:
        """As Wan's, with the Dancer's columns; a clip of a row with a true framewise_decoding may have any number
        of frames, which stand for 4 (n - 1) + 1 (`framewise_num_frames`)."""
        row = row_label(data)
        framewise = bool(data.get("framewise_decoding"))
        video = data.get("video") if data.get("video") is not None else data.get("image")
        frames = as_image_list(video)
        if framewise and frames and (len(frames) - 1) % 4:  # the base checks 4k+1: give it a count it takes
            values = super().training_inputs({**data, "video": frames[:1], "image": None})
            values.update(input_video=frames)
        else:
            values = super().training_inputs(data)
        if framewise:
            values["num_frames"] = framewise_num_frames(len(frames))
        values["wantodance_keyframes_mask"] = as_list(data.get("wantodance_keyframes_mask"),
                                                      "wantodance_keyframes_mask", row)
        values["framewise_decoding"] = framewise
        return values

    def model_fn(self, latents, timestep, prompt_embeds, image_embeds=None, condition=None,
                 wantodance_refimage_feature=None, music_feature=None, wantodance_fps=None, skip_9th_layer=None,
                 **settings):
        settings.pop("expert_boundary", None)
        return model_fn_wan_dancer(self.dit, latents, timestep, prompt_embeds, image_embeds, condition,
                                   wantodance_refimage_feature, music_feature, wantodance_fps,
                                   skip_9th_layer=bool(skip_9th_layer), **settings)

    # guidance: the negative pass skips block 9 (the reference's skip_9th_layer)
    def model_fn_kwargs(self, values):
        return {**super().model_fn_kwargs(values), "skip_9th_layer": values.get("skip_9th_layer")}

    def negative_name(self, name: str) -> str:
        return "negative_skip_9th_layer" if name == "skip_9th_layer" else super().negative_name(name)

    def denoise(self, values, cfg_scale=1.0, progress=True, settings=None):
        values["negative_skip_9th_layer"] = bool(getattr(self.dit.config, "enable_global", False))
        return super().denoise(values, cfg_scale=cfg_scale, progress=progress, settings=settings)

    def finish_latents(self, latents, values):
        self.framewise = bool(values.get("framewise_decoding"))
        return super().finish_latents(latents, values)

    def decode(self, latents, stream=None):
        if not self.framewise:
            return super().decode(latents, stream)
        video = torch.cat([vae_decode(self, latents[:, :, t:t + 1]) for t in range(latents.shape[2])], dim=2)
        return video[:, :, 0] if video.shape[2] == 1 else video


__all__ = ["DANCER_LORA_ALIASES", "WanDancerPipeline"]
