"""Wan2.2-S2V's inputs: wav2vec2's audio features per generated frame, the pose clip's and the reference image's
VAE latents; its feature and units."""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

from ....core.family import TokenizerSpec
from ....core.features import ALIGNED_AUDIO, ALIGNED_FRAMES, Feature
from ....core.units import PipelineUnit
from ....errors import UserError
from ....media.image import as_image_list
from ..units import vae_encode, video_tensor

FEATURE = "s2v"
AUDIO_RATE = 16000  # the reference's LoadAudio(sr=16000) and audio_sample_rate
# wav2vec2's convolutions span 400 samples (25 ms at 16 kHz) before its first feature
S2V_MIN_AUDIO_SECONDS = 0.025
AUDIO_FEATURE_RATE = 30  # wav2vec2's 50 features a second, interpolated to 30 (the encoder's video_rate)
VIDEO_FPS = 16  # the frame rate the audio features are sampled at


def load_audio_processor(path_or_config):
    """The wav2vec2 feature extractor (preprocessor_config.json) of --audio_processor_path's folder; the
    tokenizer beside it is not needed for features."""
    from transformers import Wav2Vec2FeatureExtractor

    from ....models.load import model_directory
    from ....util import first_line

    path = model_directory(path_or_config, "audio processor")
    try:
        return Wav2Vec2FeatureExtractor.from_pretrained(str(path))
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds for a bad folder
        raise UserError(f"{path}: cannot load the wav2vec2 audio processor ({first_line(err)})") from err


def audio_frame_indices(features: int, frames: int, fps: int = VIDEO_FPS, rate: int = AUDIO_FEATURE_RATE):
    """For each of `frames` video frames at `fps`, the audio feature (at `rate` a second) it takes: the one at its
    time, rounded half to even (numpy's round); None past the audio's end (a zero feature)."""
    times = np.linspace(0, frames / fps, frames, endpoint=False)
    index = np.round(times * rate).astype(int)
    return [int(i) if i < features else None for i in index]


def _receptive_field(encoder) -> int:
    """Samples wav2vec2's feature convolutions span before their first output."""
    span, step = 1, 1
    for k, s in zip(encoder.config.conv_kernel, encoder.config.conv_stride):
        span, step = span + (k - 1) * step, step * s
    return span


@torch.no_grad()
def s2v_audio_embeds(encoder, processor, waveform, num_frames: int, sample_rate: int = AUDIO_RATE,
                     fps: int = VIDEO_FPS) -> torch.Tensor:
    """A waveform -> (1, layers, hidden, num_frames - 1): every hidden state of wav2vec2 (the embedding output
    and each layer's), linearly interpolated from 50 to 30 a second (end points aligned), then one feature per
    generated video frame (`audio_frame_indices`), zeros past the audio's end."""
    span = _receptive_field(encoder)
    if np.shape(waveform)[-1] < span:
        n = np.shape(waveform)[-1]
        raise UserError(f"input_audio: {n} samples ({n / sample_rate:.2f} s) at {sample_rate} Hz; wav2vec2 needs "
                        f"at least {span} ({span / sample_rate:g} s)")
    values = processor(np.asarray(waveform, dtype=np.float32), sampling_rate=sample_rate,
                       return_tensors="pt").input_values
    param = next(encoder.parameters())
    hidden = encoder(values.to(param.device, param.dtype), output_hidden_states=True).hidden_states
    feats = torch.cat(hidden)  # (layers, T50, hidden)
    length = int(feats.shape[1] / 50 * AUDIO_FEATURE_RATE)
    feats = F.interpolate(feats.transpose(1, 2).float(), size=length, mode="linear", align_corners=True)
    feats = feats.transpose(1, 2)  # (layers, T30, hidden)
    frames = []
    for i in audio_frame_indices(feats.shape[1], num_frames - 1, fps):
        frames.append(feats[:, i] if i is not None else feats.new_zeros(feats.shape[0], feats.shape[2]))
    return torch.stack(frames, dim=-1)[None]  # (1, layers, hidden, F-1)


# -- units -------------------------------------------------------------------------------------------------

class WanS2VAudioEmbedder(PipelineUnit):
    """`input_audio` (a waveform at 16 kHz) -> wav2vec2's features per generated frame (`s2v_audio_embeds`)."""

    feature = FEATURE
    inputs = ("input_audio", "num_frames")
    outputs = ("audio_embeds",)
    models = ("audio_encoder",)

    def process(self, pipe, input_audio, num_frames):
        if input_audio is None:
            return {}
        processor = getattr(pipe, "audio_processor", None)
        if processor is None:
            raise UserError("Wan2.2-S2V needs the wav2vec2 audio processor: pass --audio_processor_path "
                            "(e.g. Wan-AI/Wan2.2-S2V-14B:wav2vec2-large-xlsr-53-english/)")
        waves = input_audio if isinstance(input_audio, (list, tuple)) else [input_audio]
        embeds = [s2v_audio_embeds(pipe.audio_encoder, processor, w, num_frames) for w in waves]
        return {"audio_embeds": torch.cat(embeds).to(pipe.device, pipe.torch_dtype)}


class WanS2VPoseEmbedder(PipelineUnit):
    """`s2v_pose_video` -> VAE latents of its first num_frames - 1 frames (padded with black, -1, if shorter),
    encoded behind a copy of its first frame whose latent frame is then dropped: (B, 16, (F-1)/4, h, w)."""

    feature = FEATURE
    inputs = ("s2v_pose_video", "num_frames", "height", "width")
    outputs = ("s2v_pose_latents",)
    models = ("vae",)
    skip_without = ("s2v_pose_video",)

    def process(self, pipe, s2v_pose_video, num_frames, height, width):
        clips = s2v_pose_video if s2v_pose_video and isinstance(s2v_pose_video, (list, tuple)) and \
            not hasattr(s2v_pose_video[0], "size") else [s2v_pose_video]
        out = []
        for clip in clips:
            video = video_tensor(as_image_list(clip)[:num_frames - 1], height, width)
            short = num_frames - 1 - video.shape[2]
            if short > 0:
                video = torch.cat([video, -torch.ones(1, 3, short, height, width)], dim=2)
            z = vae_encode(pipe, torch.cat([video[:, :, :1], video], dim=2))
            out.append(z[:, :, 1:])
        return {"s2v_pose_latents": torch.cat(out).to(pipe.torch_dtype)}


class WanS2VReferenceEmbedder(PipelineUnit):
    """`input_image` -> its VAE latents, the clean reference frame in front of the clip's latents (the
    reference's fused first frame for a DiT that fuses it: S2V). Stands in for TI2V-5B's fused-image unit."""

    feature = FEATURE
    replaces = ("WanImageEmbedderFused",)
    inputs = ("input_image", "height", "width", "batch_size")
    outputs = ("first_frame_latents",)
    models = ("vae",)
    skip_without = ("input_image",)

    def process(self, pipe, input_image, height, width, batch_size):
        images = input_image if isinstance(input_image, (list, tuple)) else [input_image] * int(batch_size or 1)
        z = [vae_encode(pipe, video_tensor([im], height, width)) for im in images]
        return {"first_frame_latents": torch.cat(z).to(pipe.torch_dtype)}


# -- the feature ------------------------------------------------------------------------------------------

AUDIO_PROCESSOR = TokenizerSpec(attr="audio_processor", slot="audio_encoder", folder="wav2vec2-large-xlsr-53-english",
                                load=load_audio_processor, flag="audio_processor_path")

S2V = Feature(name=FEATURE, columns=("input_audio", "s2v_pose_video"), models=("audio_encoder",),
              model_fn_inputs=("audio_embeds", "s2v_pose_latents", "first_frame_latents"),
              data_inputs=("input_audio", "s2v_pose_video", "input_image"),
              inputs={"s2v_pose_video": ALIGNED_FRAMES, "input_audio": ALIGNED_AUDIO}, fps=VIDEO_FPS,
              description="Wan2.2-S2V: speech (wav2vec2 features), pose clip and reference image")
S2V_UNITS = (WanS2VReferenceEmbedder, WanS2VAudioEmbedder, WanS2VPoseEmbedder)


__all__ = ["AUDIO_PROCESSOR", "AUDIO_RATE", "S2V_MIN_AUDIO_SECONDS", "FEATURE", "S2V", "S2V_UNITS", "WanS2VAudioEmbedder", "WanS2VPoseEmbedder",
           "WanS2VReferenceEmbedder", "audio_frame_indices", "load_audio_processor", "s2v_audio_embeds"]
