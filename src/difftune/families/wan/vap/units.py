"""Video-As-Prompt's inputs: the reference clip (`vap_video`: the branch's latents + I2V condition, its first
frame's CLIP embedding) and its prompt (`vap_prompt`); its feature and units."""

from __future__ import annotations

import torch

from ....core.features import ALIGNED_FRAMES, Feature
from ....core.units import PipelineUnit
from ....errors import UserError
from ....media.image import as_image_list
from ..units import (MAX_PROMPT_TOKENS, WanImageEmbedderCLIP, WanImageEmbedderVAE, _per_sample, vae_encode,
                     video_tensor)

FEATURE = "vap"


class WanVAPPromptEmbedder(PipelineUnit):
    """`vap_prompt` (the reference clip's description; "" when none, as the reference trains) -> UMT5 embeddings
    (`context_vap`), with its negative for guidance."""

    feature = FEATURE
    cfg_inputs = {"vap_prompt": ("vap_prompt", "negative_vap_prompt")}
    cfg_outputs = {"context_vap": ("context_vap", "negative_context_vap")}
    models = ("text_encoder",)

    def process(self, pipe, vap_prompt):
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        if getattr(pipe, "tokenizer", None) is None:
            raise UserError("no UMT5 tokenizer: pass --tokenizer_path (or tokenizer_config) to encode prompts")
        prompts = [vap_prompt or ""] if vap_prompt is None or isinstance(vap_prompt, str) else \
            ["" if p is None else p for p in vap_prompt]
        tokens = pipe.tokenizer([prompt_clean(p) for p in prompts], padding="max_length",
                                max_length=MAX_PROMPT_TOKENS, truncation=True, add_special_tokens=True,
                                return_attention_mask=True, return_tensors="pt")
        ids, mask = tokens.input_ids.to(pipe.device), tokens.attention_mask.to(pipe.device)
        hidden = pipe.text_encoder(ids, mask).last_hidden_state
        keep = torch.arange(hidden.shape[1], device=hidden.device)[None] < mask.sum(1, keepdim=True)
        return {"context_vap": (hidden * keep[..., None]).to(pipe.torch_dtype)}


class WanVAPVideoEmbedder(PipelineUnit):
    """`vap_video` -> the branch's input: its VAE latents and the I2V condition of its first frame (4-channel
    mask + latents of the first frame, then black; its last frame too when an end image is given), 36 channels;
    and its first frame's CLIP embedding."""

    feature = FEATURE
    inputs = ("vap_video", "end_image", "num_frames", "height", "width", "batch_size")
    outputs = ("vap_hidden_state", "vap_clip_feature")
    models = ("vae", "image_encoder")
    skip_without = ("vap_video",)

    def process(self, pipe, vap_video, end_image, num_frames, height, width, batch_size):
        n = int(batch_size or 1)
        clips = vap_video if n > 1 and isinstance(vap_video, (list, tuple)) and len(vap_video) == n and \
            not hasattr(vap_video[0], "size") else [vap_video] * n
        hidden, clip = [], []
        for frames, end in zip(clips, _per_sample(end_image, n)):
            frames = as_image_list(frames)
            latents = vae_encode(pipe, video_tensor(frames, height, width))
            last = frames[-1] if end is not None else None
            condition = WanImageEmbedderVAE().process(pipe, frames[0], last, num_frames, height, width, 1)
            if "condition" not in condition:
                raise UserError("Video-As-Prompt needs Wan2.1's VAE (16 channels)")
            hidden.append(torch.cat([latents.to(pipe.torch_dtype), condition["condition"]], dim=1))
            embeds = WanImageEmbedderCLIP().process(pipe, frames[0], None, height, width, 1)
            if "image_embeds" not in embeds:
                raise UserError("Video-As-Prompt needs the CLIP image encoder (models_clip_...pth)")
            clip.append(embeds["image_embeds"])
        return {"vap_hidden_state": torch.cat(hidden), "vap_clip_feature": torch.cat(clip)}


VAP_FEATURE = Feature(name=FEATURE, columns=("vap_video",), models=("vap",),
                      model_fn_inputs=("vap_hidden_state", "vap_clip_feature", "context_vap"),
                      data_inputs=("vap_video", "vap_prompt"), inputs={"vap_video": ALIGNED_FRAMES},
                      description="Video-As-Prompt: a reference clip through the mixture-of-transformers branch")
VAP_UNITS = (WanVAPPromptEmbedder, WanVAPVideoEmbedder)


__all__ = ["FEATURE", "VAP_FEATURE", "VAP_UNITS", "WanVAPPromptEmbedder", "WanVAPVideoEmbedder"]
