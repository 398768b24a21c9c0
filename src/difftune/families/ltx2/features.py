"""LTX-2's conditioning features: image-to-video (the clip's first frame given clean) and in-context video
(IC-LoRA: reference clips appended to the video tokens at timestep 0), as the reference's `InputImagesEmbedder` and
`InContextVideoEmbedder` compute them."""

from __future__ import annotations

from io import BytesIO

import numpy as np
import torch
from PIL import Image

from ...core.features import IMAGE, RAW, VALUE, Feature
from ...core.units import PipelineUnit
from ...errors import UserError, row_label
from ...media.image import as_image_list
from .units import encode_video, video_tensor

IMAGE_CRF = 33  # the first frame goes through one H.264 frame at this quality first (the reference's ltx2_preprocess)


def h264_round_trip(image: Image.Image, crf: int = IMAGE_CRF) -> Image.Image:
    """The image encoded as one H.264 frame (libx264, yuv420p, `crf`) and decoded back: the compression look the
    model's conditioning frames had in training (the reference's and LTX's own image preprocessing)."""
    import av

    array = np.asarray(image.convert("RGB"))
    h, w = array.shape[0] // 2 * 2, array.shape[1] // 2 * 2
    array = np.ascontiguousarray(array[:h, :w])
    with BytesIO() as buffer:
        with av.open(buffer, "w", format="mp4") as out:
            stream = out.add_stream("libx264", rate=1, options={"crf": str(crf), "preset": "veryfast"})
            stream.height, stream.width = h, w
            frame = av.VideoFrame.from_ndarray(array, format="rgb24").reformat(format="yuv420p")
            out.mux(stream.encode(frame))
            out.mux(stream.encode())
        buffer.seek(0)
        with av.open(buffer) as inp:
            decoded = next(inp.decode(video=0)).to_ndarray(format="rgb24")
    return Image.fromarray(decoded)


class LTX2FirstFrameEmbedder(PipelineUnit):
    """The input image's latents (one latent frame), resized to the clip's size and H.264-compressed first."""

    inputs = ("input_image", "height", "width")
    outputs = ("first_frame_latents",)
    models = ("video_vae_encoder",)
    skip_without = ("input_image",)

    def process(self, pipe, input_image, height, width):
        images = input_image if isinstance(input_image, list) else [input_image]
        latents = [encode_video(pipe, video_tensor([h264_round_trip(img.resize((width, height)))], height, width))
                   for img in images]
        return {"first_frame_latents": torch.cat(latents).to(pipe.torch_dtype)}


class I2AVFeature(Feature):
    def finish(self, pipe, latents, values):
        """The sampled clip's first latent frame is the input image's (the reference's step keeps it clean, as
        diffusers' image-to-video pipeline does; `model_fn` gives it clean at every step, so only the output is
        left to set)."""
        first = values.get("first_frame_latents")
        if first is None:
            return latents
        video = latents[pipe.stream.name].clone()
        video[:, :, :1] = first.to(video)
        return {**latents, pipe.stream.name: video}


I2AV = I2AVFeature(
    name="i2av", columns=("input_image",), units=(LTX2FirstFrameEmbedder(),), model_fn_inputs=("first_frame_latents",),
    inputs={"input_image": IMAGE}, call_inputs={"input_image": None},
    description="image-to-video: the clip's first latent frame given clean at timestep 0 (--extra_inputs input_image: "
                "the clip's first frame where the metadata has no such column)")


def _clips(value) -> list[list[Image.Image]]:
    """A column of one clip or a list of clips -> a list of clips (lists of frames)."""
    items = as_image_list(value)
    if items and all(isinstance(f, Image.Image) for f in items):
        return [items]
    return [as_image_list(c) for c in items]


class LTX2InContextEmbedder(PipelineUnit):
    """The reference clip resized to the clip's size over `in_context_downsample_factor` (multiples of 32), cut to
    the clip's frames (black frames added to reach 8k + 1) and encoded; with the factor its positions are stretched
    by."""

    inputs = ("in_context_videos", "height", "width", "num_frames", "in_context_downsample_factor")
    outputs = ("in_context_latents", "in_context_factor")
    models = ("video_vae_encoder",)
    skip_without = ("in_context_videos",)

    def process(self, pipe, in_context_videos, height, width, num_frames, in_context_downsample_factor):
        factors = in_context_downsample_factor if isinstance(in_context_downsample_factor, list) else \
            [in_context_downsample_factor]
        factors = {int(f or 1) for f in factors}
        if len(factors) > 1:
            raise UserError(f"one batch with in_context_downsample_factor {sorted(factors)}: batch 1")
        factor = factors.pop()
        nested = isinstance(in_context_videos[0], (list, tuple))  # a stage-1 batch: one clip a sample
        division = pipe.stream.division
        h = max(division, (height // factor) // division * division)
        w = max(division, (width // factor) // division * division)
        latents = []
        for clips in (in_context_videos if nested else [in_context_videos]):
            clip = as_image_list(clips)
            frames = [f.resize((w, h)) if f.size != (w, h) else f for f in clip[:num_frames]]
            n = len(frames) + (-(len(frames) - 1)) % 8
            frames += [Image.new("RGB", (w, h))] * (n - len(frames))
            latents.append(encode_video(pipe, video_tensor(frames, h, w)))
        return {"in_context_latents": torch.cat(latents).to(pipe.torch_dtype), "in_context_factor": factor}


class InContextFeature(Feature):
    def row_values(self, pipe, data, values):
        value = data.get("in_context_videos")
        out = {}
        if value is not None:
            clips = _clips(value)
            if not clips or not all(clip and all(isinstance(f, Image.Image) for f in clip) for clip in clips):
                raise UserError(f"{row_label(data)}: 'in_context_videos' must be a clip (or a list of one) "
                                f"listed in --data_file_keys")
            if len(clips) > 1:
                raise UserError(f"{row_label(data)}: {len(clips)} in_context_videos: one a row (the "
                                f"reference stacks several on the latent channels, which its DiT cannot take)")
            out["in_context_videos"] = clips[0]
        factor = data.get("in_context_downsample_factor")
        if factor is not None:
            try:
                factor = int(factor)
            except (TypeError, ValueError):
                factor = 0
            if factor < 1:
                raise UserError(f"{row_label(data)}: in_context_downsample_factor "
                                f"{data.get('in_context_downsample_factor')!r}: a whole number of at least 1")
            out["in_context_downsample_factor"] = factor
        return out

    def signature(self, sample):
        clips = sample.get("in_context_videos")
        return (None if clips is None else tuple((c[0].size, len(c)) for c in _clips(clips)),
                sample.get("in_context_downsample_factor"))


IN_CONTEXT = InContextFeature(
    name="in_context", columns=("in_context_videos",), units=(LTX2InContextEmbedder(),),
    data_inputs=("in_context_videos", "in_context_downsample_factor"),
    model_fn_inputs=("in_context_latents", "in_context_factor"),
    inputs={"in_context_videos": RAW, "in_context_downsample_factor": VALUE},
    call_inputs={"in_context_videos": None, "in_context_downsample_factor": 1},
    description="in-context video (IC-LoRA): reference clips appended to the video tokens at timestep 0, their "
                "positions stretched by in_context_downsample_factor")

FEATURES = (I2AV, IN_CONTEXT)

__all__ = ["FEATURES", "I2AV", "IN_CONTEXT", "h264_round_trip"]
