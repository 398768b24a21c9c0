"""Wan2.2-Animate-2's inputs: the reference image (CLIP, the leading latent frame and its condition), the reference
video (its latents, condition, first frame's CLIP and prompt), the continuation frames; its feature and units."""

from __future__ import annotations

import math

import torch

from ....core.features import FRAMES, IMAGE, VALUE, Feature
from ....core.units import PipelineUnit
from ....errors import UserError
from ....media.image import as_image_list
from ..units import (WanImageEmbedderCLIP, WanInputVideoEmbedder, WanNoiseInitializer, WanPromptEmbedder, _per_sample,
                     vae_encode, vae_scales, video_tensor)

DEFAULT_PROMPT_REF = " "  # the reference's animate2_prompt_ref default


def _clips(value, batch_size: int) -> list:
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], (list, tuple)):
        return [list(v) for v in value]
    return [as_image_list(value)] * batch_size


def i2v_mask(latent_frames: int, h: int, w: int, known: int, temporal: int = 4) -> torch.Tensor:
    """(4, latent frames, h, w): pixel frames [0, known) known, the first standing for `temporal` frames."""
    m = torch.zeros(1, (latent_frames - 1) * temporal + 1, h, w)
    m[:, :known] = 1
    m = torch.cat([m[:, :1].repeat_interleave(temporal, dim=1), m[:, 1:]], dim=1)
    return m.view(1, m.shape[1] // temporal, temporal, h, w).transpose(1, 2)[0]


class WanAnimate2PromptEmbedder(PipelineUnit):
    """The reference video's prompt (`animate2_prompt_ref`, " " when not given) through UMT5."""

    feature = "animate2"
    inputs = ("animate2_prompt_ref", "animate2_reference_video", "batch_size")
    outputs = ("animate2_prompt_embeds",)
    models = ("text_encoder",)
    skip_without = ("animate2_reference_video",)

    def process(self, pipe, animate2_prompt_ref, animate2_reference_video, batch_size):
        prompts = [DEFAULT_PROMPT_REF if p is None or (isinstance(p, float) and math.isnan(p)) else str(p)
                   for p in _per_sample(animate2_prompt_ref, int(batch_size or 1))]
        return {"animate2_prompt_embeds": WanPromptEmbedder().process(pipe, prompts)["prompt_embeds"]}


class WanAnimate2CLIPEmbedder(PipelineUnit):
    """CLIP of the reference image (the clip's image embedding) and of the reference video's first frame."""

    feature = "animate2"
    replaces = ("WanImageEmbedderCLIP",)
    inputs = ("animate2_reference_image", "animate2_reference_video", "height", "width", "batch_size")
    outputs = ("image_embeds", "animate2_reference_image_embeds")
    models = ("image_encoder",)

    def process(self, pipe, animate2_reference_image, animate2_reference_video, height, width, batch_size):
        if animate2_reference_image is None or animate2_reference_video is None:
            return {}
        n = int(batch_size or 1)
        clip = WanImageEmbedderCLIP()
        images = _per_sample(animate2_reference_image, n)
        firsts = [c[0] for c in _clips(animate2_reference_video, n)]

        def embed(ims):
            return clip.process(pipe, ims if n > 1 else ims[0], None, height, width, n)["image_embeds"]

        return {"image_embeds": embed(images), "animate2_reference_image_embeds": embed(firsts)}


class WanAnimate2VAEEmbedder(PipelineUnit):
    """The clip's condition (B, 20, latent frames + 1, h, w): the reference image (mask 1, its latents) as the first
    latent frame, then the continuation frames (`animate2_refert_images`, the previous clip's tail; none in
    training: zeros, mask 0); the reference video's latents (B, 16, F', h, w) and their condition (mask 1)."""

    feature = "animate2"
    replaces = ("WanImageEmbedderVAE",)
    inputs = ("animate2_reference_image", "animate2_reference_video", "animate2_refert_images", "num_frames",
              "height", "width", "batch_size")
    outputs = ("condition", "animate2_condition_latents", "animate2_condition_y")
    models = ("vae",)

    def process(self, pipe, animate2_reference_image, animate2_reference_video, animate2_refert_images, num_frames,
                height, width, batch_size):
        if animate2_reference_image is None or animate2_reference_video is None:
            return {}
        n = int(batch_size or 1)
        _, spatial, temporal = vae_scales(pipe.vae)
        h, w = height // spatial, width // spatial
        conds, latents, ys = [], [], []
        for image, video, tail in zip(_per_sample(animate2_reference_image, n), _clips(animate2_reference_video, n),
                                      _per_sample(animate2_refert_images, n)):
            ref = vae_encode(pipe, video_tensor([image], height, width))[0]
            tail = as_image_list(tail)
            if len(tail) >= num_frames:
                raise UserError(f"animate2_refert_images: {len(tail)} frames, fewer than the clip's {num_frames} "
                                f"expected")
            pixels = torch.zeros(1, 3, num_frames, height, width)
            if tail:
                pixels[:, :, :len(tail)] = video_tensor(tail, height, width)
            rest = vae_encode(pipe, pixels)[0]
            conds.append(torch.cat([torch.cat([i2v_mask(1, h, w, 1, temporal).to(ref), ref]),
                                    torch.cat([i2v_mask(rest.shape[1], h, w, len(tail), temporal).to(rest), rest])],
                                   dim=1))
            frames = video[:num_frames]
            z = vae_encode(pipe, video_tensor(frames, height, width))[0]
            latents.append(z)
            ys.append(torch.cat([i2v_mask(z.shape[1], h, w, len(frames), temporal).to(z), z]))
        dtype = pipe.torch_dtype
        return {"condition": torch.stack(conds).to(dtype), "animate2_condition_latents": torch.stack(latents).to(dtype),
                "animate2_condition_y": torch.stack(ys).to(dtype)}


class WanAnimate2NoiseInitializer(WanNoiseInitializer):
    """The noise with one more leading latent frame (the reference image's; dropped after sampling)."""

    feature = "animate2"
    replaces = ("WanNoiseInitializer",)
    inputs = WanNoiseInitializer.inputs + ("animate2_reference_video",)

    def process(self, pipe, height, width, num_frames, seed, rand_device, batch_size, animate2_reference_video=None):
        _, _, temporal = vae_scales(pipe.vae)
        extra = temporal if animate2_reference_video is not None else 0
        return super().process(pipe, height, width, int(num_frames) + extra, seed, rand_device, batch_size)


class WanAnimate2InputVideoEmbedder(WanInputVideoEmbedder):
    """Training: the reference image's clean latents lead the clip's (the loss covers them, as in the reference)."""

    feature = "animate2"
    replaces = ("WanInputVideoEmbedder",)
    inputs = WanInputVideoEmbedder.inputs + ("animate2_reference_image", "animate2_reference_video")

    def process(self, pipe, input_video, noise, height, width, animate2_reference_image=None,
                animate2_reference_video=None):
        out = super().process(pipe, input_video, noise, height, width)
        if "input_latents" not in out or animate2_reference_image is None or animate2_reference_video is None:
            return out
        latents = out["input_latents"]
        refs = [vae_encode(pipe, video_tensor([im], height, width))
                for im in _per_sample(animate2_reference_image, latents.shape[0])]
        out["input_latents"] = torch.cat([torch.cat(refs).to(latents), latents], dim=2)
        return out


class WanAnimate2Guidance(PipelineUnit):
    """Which pass model_fn runs: the guided one (True) or, on classifier-free guidance's unguided side, the one
    that skips block 9 (False), as the reference's `positive` input. No model."""

    feature = "animate2"
    outputs = ("animate2_conditional", "negative_animate2_conditional")

    def process(self, pipe):
        return {"animate2_conditional": True, "negative_animate2_conditional": False}


ANIMATE2 = Feature("animate2", when=lambda c: True,
                   data_inputs=("animate2_prompt_ref", "animate2_reference_image", "animate2_reference_video",
                                "animate2_refert_images"),
                   model_fn_inputs=("image_embeds", "condition", "animate2_condition_latents", "animate2_condition_y",
                                    "animate2_prompt_embeds", "animate2_reference_image_embeds",
                                    "animate2_conditional"),
                   inputs={"animate2_reference_image": IMAGE, "animate2_reference_video": FRAMES,
                           "animate2_refert_images": FRAMES, "animate2_prompt_ref": VALUE},
                   description="Wan2.2-Animate-2: a reference image and a reference video (with its prompt) read "
                               "in context")
ANIMATE2_COLUMNS = ("animate2_prompt_ref", "animate2_reference_image", "animate2_reference_video")


__all__ = ["ANIMATE2", "ANIMATE2_COLUMNS", "DEFAULT_PROMPT_REF", "WanAnimate2CLIPEmbedder", "WanAnimate2Guidance",
           "WanAnimate2InputVideoEmbedder", "WanAnimate2NoiseInitializer", "WanAnimate2PromptEmbedder",
           "WanAnimate2VAEEmbedder", "i2v_mask"]
