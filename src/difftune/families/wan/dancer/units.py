"""Wan-Dancer's inputs: the music's librosa features, the reference image's CLIP embedding, the keyframes' I2V
condition, the global model's frame-by-frame latents and the frame rate; its features and units."""

from __future__ import annotations

import torch

from ....core.batch import SAME
from ....core.features import Feature
from ....core.units import PipelineUnit
from ....errors import UserError
from ....media.image import as_image_list
from ..units import WanImageEmbedderCLIP, WanInputVideoEmbedder, vae_encode, vae_scales, video_tensor
from ..variant import dit_class
from .model import NATIVE_FPS

FEATURE = "dancer"
FRAMEWISE = "dancer_framewise"


# -- the music features -----------------------------------------------------------------------------------

LIBROSA_MISSING = ("wantodance_music_path: Wan-Dancer's music features are librosa's (as the reference's), and "
                   "librosa is not installed: pip install 'difftune[audio]'")


def has_librosa() -> bool:
    import importlib.util

    return importlib.util.find_spec("librosa") is not None


def music_features(path: str, fps: int = NATIVE_FPS):
    """The reference's music features of an audio file, (T, 35) float32 at `fps` a second (librosa: onset
    strength, 20 MFCCs, 12 CENS chroma, onset-peak and beat one-hots), computed as the reference does (the
    audio loaded at fps x 512 Hz, the features at librosa's 22050 Hz default settings, the starting tempo from
    the file at 22050 Hz)."""
    try:
        import librosa
        import numpy as np
    except ImportError:
        raise UserError(LIBROSA_MISSING) from None
    from ....media.audio import AudioError, check_audio

    try:
        check_audio(path)
    except AudioError as err:
        raise UserError(str(err)) from None
    hop = 512
    data, _ = librosa.load(path, sr=fps * hop)
    sr = 22050
    envelope = librosa.onset.onset_strength(y=data, sr=sr)
    mfcc = librosa.feature.mfcc(y=data, sr=sr, n_mfcc=20).T
    chroma = librosa.feature.chroma_cens(y=data, sr=sr, hop_length=hop, n_chroma=12).T
    peaks = librosa.onset.onset_detect(onset_envelope=envelope.flatten(), sr=sr, hop_length=hop)
    peak = np.zeros_like(envelope, dtype=np.float32)
    peak[peaks] = 1.0
    # librosa.beat.tempo (the reference's call) moved to librosa.feature.rhythm.tempo in 0.10 and is gone in 1.0
    tempo_of = getattr(getattr(librosa.feature, "rhythm", None), "tempo", None) or librosa.beat.tempo
    tempo = tempo_of(y=librosa.load(path)[0])[0]
    _, beats = librosa.beat.beat_track(onset_envelope=envelope, sr=sr, hop_length=hop, start_bpm=tempo, tightness=100)
    beat = np.zeros_like(envelope, dtype=np.float32)
    beat[beats] = 1.0
    feats = np.concatenate([envelope[:, None], mfcc, chroma, peak[:, None], beat[:, None]], axis=-1)
    return torch.from_numpy(feats.astype(np.float32))


# -- units -------------------------------------------------------------------------------------------------

class WanDancerMusic(PipelineUnit):
    """`wantodance_music_path` -> the music's features (`music_features`); no model, so always cached."""

    feature = FEATURE
    inputs = ("wantodance_music_path",)
    outputs = ("music_feature",)
    skip_without = ("wantodance_music_path",)

    def process(self, pipe, wantodance_music_path):
        paths = wantodance_music_path if isinstance(wantodance_music_path, (list, tuple)) else [wantodance_music_path]
        feats = [music_features(str(p)) for p in paths]
        if len({f.shape for f in feats}) > 1:
            raise UserError("Wan-Dancer: the music of one batch must be equally long")
        return {"music_feature": torch.stack(feats).to(pipe.torch_dtype)}


class WanDancerReferenceImage(PipelineUnit):
    """`wantodance_reference_image` -> its CLIP embedding (the cross-attention's image tokens)."""

    feature = FEATURE
    inputs = ("wantodance_reference_image", "height", "width")
    outputs = ("wantodance_refimage_feature",)
    models = ("image_encoder",)
    skip_without = ("wantodance_reference_image",)

    def process(self, pipe, wantodance_reference_image, height, width):
        image = wantodance_reference_image
        image = as_image_list(image)[0] if not hasattr(image, "size") or isinstance(image, list) else image
        out = WanImageEmbedderCLIP().process(pipe, image, None, height, width, 1)
        return {"wantodance_refimage_feature": out["image_embeds"]} if "image_embeds" in out else {}


def keyframe_mask(mask, num_frames: int, height: int, width: int, spatial: int = 8, temporal: int = 4):
    """The 4-channel I2V mask of the keyframes: 1 on the frames `mask` marks, the first frame standing for
    `temporal` frames as the VAE's first latent frame does: (1, 4, latent frames, h, w)."""
    mask = torch.as_tensor(mask, dtype=torch.float32).flatten()
    if mask.numel() != num_frames:
        raise UserError(f"wantodance_keyframes_mask has {mask.numel()} entries, the clip {num_frames} frames")
    known = (mask == 1).float()
    known = torch.cat([known[:1].repeat(temporal), known[1:]])
    h, w = height // spatial, width // spatial
    return known.view(-1, temporal, 1, 1).expand(-1, temporal, h, w).transpose(0, 1)[None]


class WanDancerKeyframes(PipelineUnit):
    """`wantodance_keyframes` (a clip: keyframes, black elsewhere) and `wantodance_keyframes_mask` -> the I2V
    condition (the keyframe mask + the keyframes' VAE latents) and the first keyframe's CLIP embedding; stands in
    for the input-image condition."""

    feature = FEATURE
    replaces = ("WanImageEmbedderCLIP", "WanImageEmbedderVAE")
    inputs = ("wantodance_keyframes", "wantodance_keyframes_mask", "num_frames", "height", "width")
    outputs = ("image_embeds", "condition")
    models = ("image_encoder", "vae")
    skip_without = ("wantodance_keyframes",)

    def process(self, pipe, wantodance_keyframes, wantodance_keyframes_mask, num_frames, height, width):
        if wantodance_keyframes_mask is None:
            raise UserError("wantodance_keyframes needs wantodance_keyframes_mask (which frames are keyframes)")
        frames = as_image_list(wantodance_keyframes)
        _, spatial, temporal = vae_scales(pipe.vae)
        z = vae_encode(pipe, video_tensor(frames, height, width))
        mask = keyframe_mask(wantodance_keyframes_mask, num_frames, height, width, spatial, temporal)
        if mask.shape[2] != z.shape[2]:
            raise UserError(f"wantodance_keyframes: {len(frames)} frames give {z.shape[2]} latent frames, the mask "
                            f"of {num_frames} frames {mask.shape[2]}")
        clip = WanImageEmbedderCLIP().process(pipe, frames[0], None, height, width, 1)
        out = {"condition": torch.cat([mask.to(z.device, z.dtype), z], dim=1).to(pipe.torch_dtype)}
        if "image_embeds" in clip:
            out["image_embeds"] = clip["image_embeds"]
        return out


class WanDancerFramewiseVideo(PipelineUnit):
    """The global model's clips (a true `framewise_decoding`): every frame VAE-encoded alone, one latent frame
    each; other rows' clips as usual."""

    feature = FRAMEWISE
    replaces = ("WanInputVideoEmbedder",)
    inputs = ("input_video", "noise", "height", "width", "framewise_decoding")
    outputs = ("latents", "input_latents")
    models = ("vae",)

    def process(self, pipe, input_video, noise, height, width, framewise_decoding):
        if input_video is None:
            return {"latents": noise}
        frames = as_image_list(input_video)
        if not framewise_decoding:
            return WanInputVideoEmbedder().process(pipe, input_video, noise, height, width)
        latents = torch.cat([vae_encode(pipe, video_tensor([f], height, width)) for f in frames], dim=2)
        if pipe.scheduler.training:
            return {"latents": noise, "input_latents": latents}
        raise UserError("video-to-video sampling (input_video) is not supported yet")


class WanDancerFps(PipelineUnit):
    """`wantodance_fps`: the clip's frame rate (30 when not given, the plain path), a positive number."""

    feature = FEATURE
    inputs = ("wantodance_fps",)
    outputs = ("wantodance_fps",)
    batching = {"wantodance_fps": SAME}  # one path per batch: the global or the plain one

    def process(self, pipe, wantodance_fps):
        values = wantodance_fps if isinstance(wantodance_fps, (list, tuple)) else [wantodance_fps]
        rates = {NATIVE_FPS if v is None else v for v in values}
        try:
            rates = {float(v) for v in rates}
        except (TypeError, ValueError):
            raise UserError(f"wantodance_fps must be a number (frames a second), got {sorted(map(str, rates))}") \
                from None
        if len(rates) != 1 or min(rates) <= 0:
            raise UserError(f"wantodance_fps must be one positive number per batch, got {sorted(rates)}")
        return {"wantodance_fps": rates.pop()}


def is_dancer(context) -> bool:
    return dit_class(context) == "WanDancerTransformer"


DANCER = Feature(name=FEATURE, when=lambda c: is_dancer(c) or c.has("wantodance_music_path", "wantodance_keyframes",
                                                                    "wantodance_reference_image"),
                 model_fn_inputs=("wantodance_refimage_feature", "music_feature", "wantodance_fps", "image_embeds",
                                  "condition"),
                 data_inputs=("wantodance_music_path", "wantodance_reference_image", "wantodance_fps",
                              "wantodance_keyframes", "wantodance_keyframes_mask"),
                 description="Wan-Dancer: music, reference image and keyframes")
# the global model's data: a `framewise_decoding` column (and --framewise_decoding for the frame count rule)
DANCER_FRAMEWISE = Feature(name=FRAMEWISE, columns=("framewise_decoding",), requires=(FEATURE,),
                           data_inputs=("framewise_decoding",),
                           description="Wan-Dancer global: one latent frame per video frame")
DANCER_UNITS = (WanDancerFps, WanDancerMusic, WanDancerReferenceImage, WanDancerKeyframes, WanDancerFramewiseVideo)


def framewise_num_frames(clip_frames: int) -> int:
    """The frame count the global model's latents stand for: 4 (n - 1) + 1 for n framewise-encoded frames (the
    reference's training script sets num_frames so)."""
    return 4 * (int(clip_frames) - 1) + 1


__all__ = ["DANCER", "DANCER_FRAMEWISE", "DANCER_UNITS", "FEATURE", "FRAMEWISE", "LIBROSA_MISSING", "WanDancerFps",
           "WanDancerFramewiseVideo", "WanDancerKeyframes", "WanDancerMusic", "WanDancerReferenceImage",
           "framewise_num_frames", "has_librosa", "is_dancer", "keyframe_mask", "music_features"]
