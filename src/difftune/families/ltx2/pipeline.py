"""`LTX2Pipeline`: LTX-2 / LTX-2.3 / JoyAI-Echo text-(and image-)to-video with its sound: two streams (the clip's
latents and its sound's) through one DiT at one timestep, the reference's `LTX2AudioVideoPipeline` and
`model_fn_ltx2` in diffusers' classes.

The DiT takes both token sequences: the clip's latents packed to (B, F*H*W, 128) with their pixel-space positions
(time in seconds: the frame rate matters), the sound's (B, L, 8*16) with theirs, one context per stream from the
text connectors, and a timestep per token (0..1000; the image-to-video first frame and the in-context clip's tokens
at 0). It predicts the flow (noise - x0) of each stream."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch

from ...core.batch import SAME
from ...core.checkpointing import set_gradient_checkpointing
from ...core.options import sample_input
from ...core.pipeline import BasePipeline
from ...core.target import AudioStream, FrameRule, Target, VideoStream
from ...data.audio import LoadAudioClip
from ...errors import UserError, row_label
from .audio import LATENT_HOP, SAMPLE_RATE
from .features import FEATURES
from .units import UNITS, audio_latent_frames, pack_sound, unpack_sound

DEFAULT_FRAME_RATE = 24.0
OUTPUT_RATE = 48000  # LTX-2.3's vocoder's (with bandwidth extension); 2.0's 24 kHz is resampled to it
CALL_DEFAULTS = {"height": 512, "width": 768, "num_frames": 121, "num_inference_steps": 40, "cfg_scale": 3.0}
# The reference's training table: linspace(1, 0, 1001)[:-1], the exponential time shift at mu = 2.05 (its shift
# for a 4096-token clip, used at every size), stretched so the last sigma is 0.1; bell weights. Sampling shifts by
# the clip's tokens, as diffusers' LTX2Pipeline.
SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "use_dynamic_shifting": True, "base_shift": 0.95,
                    "max_shift": 2.05, "base_image_seq_len": 1024, "max_image_seq_len": 4096, "shift_terminal": 0.1,
                    "time_shift_type": "exponential"}
TRAINING_MU = 2.05


def _denormalise(vae, latents):
    mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(latents.device, torch.float32)
    std = vae.latents_std.view(1, -1, 1, 1, 1).to(latents.device, torch.float32)
    return latents.float() * std / vae.config.scaling_factor + mean


@dataclass(frozen=True, eq=False)
class LTX2Clips(VideoStream):
    """Clips of 8k + 1 frames (121 by default), sizes in multiples of 32; latents (128, F', H/32, W/32);
    --extra_inputs input_image is the clip's first frame where the metadata has no such column."""

    channels: int = 128
    scale: int = 32
    temporal: int = 8
    division: int = 32
    frames: FrameRule = FrameRule(121, 8, 1)
    fps: float = DEFAULT_FRAME_RATE
    owner: str = "LTX-2"
    decode_models: tuple[str, ...] = ("video_vae_decoder",)
    frame_inputs: Mapping = field(default_factory=lambda: {"input_image": ("video", 0)})
    clip_columns: tuple[str, ...] = ("video",)

    def scales(self, pipe):
        for slot in ("video_vae_encoder", "video_vae_decoder"):
            vae = (getattr(pipe, "models", {}) or {}).get(slot)
            if vae is not None:
                return int(vae.config.latent_channels), self.scale, self.temporal
        dit = (getattr(pipe, "models", {}) or {}).get("dit")
        return (int(dit.config.in_channels) if dit is not None else self.channels), self.scale, self.temporal

    def seq_len(self, latents):
        return int(latents.shape[2] * latents.shape[3] * latents.shape[4])

    def size_seq_len(self, values):
        frames = (int(values.get("num_frames") or self.frames.default) - 1) // self.temporal + 1
        return frames * (int(values["height"]) // self.scale) * (int(values["width"]) // self.scale)

    def output_fps(self, call) -> float:
        return float(call.get("frame_rate") or self.fps)

    def decode(self, pipe, latents):
        vae = pipe.video_vae_decoder
        if vae is None:
            raise UserError("decoding the clip needs the video VAE decoder (video_vae_decoder.safetensors)")
        return vae.decode(_denormalise(vae, latents).to(vae.dtype), return_dict=False)[0]


@dataclass(frozen=True, eq=False)
class LTX2Sound(AudioStream):
    """The clip's sound: 16 kHz stereo in (mono upmixed), latents (8, L, 16) at 25 a second, as long as the clip
    (`input_audio`: an audio file, or the clip's own file for its sound track); out through the vocoder."""

    name: str = "audio"
    column: str = "input_audio"
    input: str = "input_audio"
    latents: str = "audio_latents"
    input_latents: str = "audio_input_latents"
    channels: int = 8
    scale: int = LATENT_HOP
    sample_rate: int = SAMPLE_RATE
    audio_channels: int = 2
    fps: float = DEFAULT_FRAME_RATE
    mel_bins: int = 16
    output_rate: int = OUTPUT_RATE
    decode_models: tuple[str, ...] = ("audio_vae_decoder", "audio_vocoder")

    def latent_shape(self, pipe) -> tuple[int, int]:
        """(channels, mel bins) of the sound's latents: the audio VAE's, else the DiT's input split in 16 bins."""
        for slot in ("audio_vae_encoder", "audio_vae_decoder"):
            vae = (getattr(pipe, "models", {}) or {}).get(slot)
            if vae is not None:
                return int(vae.config.latent_channels), int(vae.config.mel_bins) // 4
        dit = (getattr(pipe, "models", {}) or {}).get("dit")
        if dit is not None:
            return int(dit.config.audio_in_channels) // self.mel_bins, self.mel_bins
        return self.channels, self.mel_bins

    def noise_shape(self, pipe, num_frames=None, frame_rate=None, seconds=None, **_):
        rate = float(frame_rate or self.fps)
        frames = int(num_frames) if num_frames is not None else round(float(seconds or 5.0) * rate)
        channels, bins = self.latent_shape(pipe)
        return (channels, audio_latent_frames(frames, rate), bins)

    def seq_len(self, latents):
        return int(latents.shape[-2])

    def size_of(self, pipe, latents):
        return {"seconds": int(latents.shape[-2]) * self.scale / self.sample_rate}

    def decode(self, pipe, latents):
        vae, vocoder = pipe.audio_vae_decoder, pipe.audio_vocoder
        if vae is None or vocoder is None:
            raise UserError("decoding the sound needs the audio VAE decoder and the vocoder "
                            "(audio_vae_decoder.safetensors, audio_vocoder.safetensors)")
        packed = pack_sound(latents.float())
        z = unpack_sound(packed * vae.latents_std.to(packed) + vae.latents_mean.to(packed), latents.shape[-1])
        mel = vae.decode(z.to(vae.dtype), return_dict=False)[0]
        wave = vocoder(mel.to(next(vocoder.parameters()).dtype)).float()
        rate = int(vocoder.config.output_sampling_rate)
        if rate != self.rate_out:  # LTX-2.0's vocoder speaks at 24 kHz: written at the 48 kHz of 2.3's
            from ...media.audio import resample

            wave = torch.stack([torch.from_numpy(resample(w.cpu().numpy(), rate, self.rate_out)) for w in wave])
        return wave

    def operator(self, size, frames=None):
        from ...data.operators import ToAbsolutePath

        return ToAbsolutePath(size["base_path"]) >> SoundFile(self.sample_rate, self.audio_channels,
                                                              unit_seconds=self.scale / self.sample_rate)


class SoundFile(LoadAudioClip):
    """A sound file (or a clip's sound track) -> (channels, samples) at 16 kHz (`LoadAudioClip`: mono upmixed with a
    note, resampled by FFmpeg), the file's path kept on the tensor (`source`) for the notes of its alignment to
    the clip (`units.LTX2AudioEmbedder`)."""

    def __call__(self, path, context=None):
        wave = super().__call__(path, context)
        wave.source = str(path)
        return wave


def _one(value, what: str, cast=float):
    """A value every sample of a batch shares (one per sample when batched from the cache; a tensor of them)."""
    if isinstance(value, torch.Tensor):
        value = value.reshape(-1).tolist()
    values = value if isinstance(value, (list, tuple)) else [value]
    found = {cast(v) for v in values}
    if len(found) > 1:
        raise UserError(f"one batch with {what} {sorted(found)}: train with batch size 1")
    return found.pop()


def _pack(latents):
    """(B, C, F, H, W) -> (B, F*H*W, C)."""
    return latents.flatten(2).transpose(1, 2)


class LTX2Pipeline(BasePipeline):
    model_names = ("dit", "text_encoder", "text_encoder_post_modules", "video_vae_encoder", "video_vae_decoder",
                   "audio_vae_encoder", "audio_vae_decoder", "audio_vocoder")
    loss_models = ("dit",)
    features = FEATURES
    settings = frozenset({"batch_size", "rand_device", "use_gradient_checkpointing",
                          "use_gradient_checkpointing_offload", "run_frame_rate"})
    model_fn_inputs = ("video_context", "audio_context", "frame_rate")
    data_inputs = ("video", "input_audio", "prompt", "seed", "rand_device", "frame_rate")
    input_batching = {"height": SAME, "width": SAME, "num_frames": SAME, "rand_device": SAME, "frame_rate": SAME}
    batch_shared_inputs = ("height", "width", "num_frames", "rand_device", "frame_rate")
    call_defaults = CALL_DEFAULTS
    call_parameters = {"num_frames": CALL_DEFAULTS["num_frames"], "frame_rate": DEFAULT_FRAME_RATE}
    sample_flags = {"frame_rate": sample_input("LTX-2: frames per second of the clip (default 24).", kind=float)}
    target = Target((LTX2Clips(), LTX2Sound()))
    scheduler_config = SCHEDULER_CONFIG
    training_mu = TRAINING_MU
    base_units = UNITS

    @classmethod
    def data_operators(cls, config) -> dict:
        """The clips resampled to --frame_rate (by their timestamps), cropped to 32-multiples."""
        from ...data.video import video_operator
        from ...training.builders import rounded_size

        options = getattr(config, "family_options", None)
        rate = float(getattr(options, "frame_rate", None) or DEFAULT_FRAME_RATE)
        division = cls.target.primary.division
        height, width = rounded_size(config, division, lambda *_: None)
        frames = config.frames.as_dict() if config.frames is not None else {}
        video = video_operator(config.dataset_base_path, height, width, config.max_pixels, division, division,
                               **frames, fps=rate)
        return {**super().data_operators(config), "video": video, "in_context_videos": video}

    def training_inputs(self, data):
        values = super().training_inputs(data)
        frame_rate = values.get("frame_rate")
        if frame_rate is not None:
            try:
                frame_rate = float(frame_rate)
            except (TypeError, ValueError):
                frame_rate = -1.0
            if not frame_rate > 0:
                raise UserError(f"{row_label(data)}: frame_rate {values.get('frame_rate')!r}: a positive "
                                f"number of frames per second")
            values["frame_rate"] = frame_rate
        return values

    def set_timesteps(self, values, num_inference_steps: int, denoising_strength: float = 1.0) -> None:
        """linspace(1, 1/N, N) shifted for the clip's tokens and stretched to end at 0.1 (diffusers' LTX2Pipeline)."""
        self.scheduler.set_timesteps(num_inference_steps, denoising_strength=denoising_strength,
                                     image_seq_len=self.image_seq_len(values))

    def negative_name(self, name: str) -> str:
        if name in ("video_context", "audio_context"):
            return "negative_" + name
        return name

    def model_fn(self, latents, audio_latents, timestep, video_context, audio_context, frame_rate=None,
                 first_frame_latents=None, in_context_latents=None, in_context_factor=None,
                 run_frame_rate=None, use_gradient_checkpointing=False, use_gradient_checkpointing_offload=False,
                 **_):
        dit = self.dit
        if dit is None:
            raise UserError("no LTX-2 DiT loaded")
        dtype = next(dit.parameters()).dtype
        device = latents.device
        fps = _one(frame_rate or run_frame_rate or DEFAULT_FRAME_RATE, 'frame_rate')
        b, c, f, h, w = latents.shape
        set_gradient_checkpointing(dit, use_gradient_checkpointing, use_gradient_checkpointing_offload)
        t = timestep.to(device, torch.float32).reshape(-1).expand(b)
        video = latents
        video_t = t[:, None, None, None].expand(b, f, h, w).clone()
        if first_frame_latents is not None:  # the first latent frame given clean, at timestep 0
            video = latents.clone()
            video[:, :, :1] = first_frame_latents.to(device, latents.dtype)
            video_t[:, 0] = 0
        tokens, video_t = _pack(video), video_t.reshape(b, -1)
        coords = dit.rope.prepare_video_coords(b, f, h, w, device, fps=fps)
        n_video = tokens.shape[1]
        if in_context_latents is not None:
            ref = in_context_latents.to(device, latents.dtype)
            rf, rh, rw = ref.shape[2:]
            ref_coords = dit.rope.prepare_video_coords(b, rf, rh, rw, device, fps=fps)
            ref_coords[:, 1:] = ref_coords[:, 1:] * _one(in_context_factor or 1, 'in_context_downsample_factor', int)  # height, width stretched
            tokens = torch.cat([tokens, _pack(ref)], dim=1)
            coords = torch.cat([coords, ref_coords], dim=2)
            video_t = torch.cat([video_t, torch.zeros(b, ref.shape[2] * rh * rw, device=device)], dim=1)
        audio_tokens = pack_sound(audio_latents)
        # each stream's cross-attention modulation reads the other stream's sigma (the reference's, and diffusers'
        # pipelines'), not the per-token timesteps that hold a given first frame or in-context clip at 0
        audio_coords = dit.audio_rope.prepare_audio_coords(b, audio_tokens.shape[1], device)
        out_video, out_audio = dit(
            hidden_states=tokens.to(dtype), audio_hidden_states=audio_tokens.to(dtype),
            encoder_hidden_states=video_context.to(device, dtype), audio_encoder_hidden_states=audio_context.to(device, dtype),
            timestep=video_t, audio_timestep=t, sigma=t, video_coords=coords, audio_coords=audio_coords,
            fps=fps, use_cross_timestep=True, return_dict=False)
        out_video = out_video[:, :n_video].transpose(1, 2).reshape(b, -1, f, h, w)
        out_audio = unpack_sound(out_audio, audio_latents.shape[-1])
        return {"video": out_video.to(latents.dtype), "audio": out_audio.to(audio_latents.dtype)}


__all__ = ["CALL_DEFAULTS", "DEFAULT_FRAME_RATE", "LTX2Clips", "LTX2Pipeline", "LTX2Sound", "SCHEDULER_CONFIG",
           "TRAINING_MU"]
