"""LTX-2's units: the size check, both streams' noise, the prompt through Gemma-3 and the text connectors, the
clip's and its sound's latents (the reference's `LTX2AudioVideoUnit_*`, in diffusers' classes)."""

from __future__ import annotations

import torch

from ...core.latents import seeded_noise
from ...core.units import PipelineUnit
from ...errors import UserError
from ...media.image import as_image_list, images_to_tensor
from .audio import LATENT_HOP, align, aligned_samples, log_mel

MAX_PROMPT_TOKENS = 1024  # Gemma's prompt, padded on the left (the reference and diffusers)


def video_tensor(frames, height: int, width: int) -> torch.Tensor:
    """PIL frames -> (1, 3, F, H, W) in [-1, 1] at (height, width)."""
    return images_to_tensor(as_image_list(frames), height, width).permute(1, 0, 2, 3).unsqueeze(0)


def encode_video(pipe, video: torch.Tensor) -> torch.Tensor:
    """(B, 3, F, H, W) in [-1, 1] -> normalised latents (B, C, F', H/32, W/32): the posterior mode, then (x - mean)
    * scaling / std per channel (the reference's `per_channel_statistics.normalize`), float32."""
    vae = pipe.video_vae_encoder
    z = vae.encode(video.to(device=pipe.device, dtype=vae.dtype)).latent_dist.mode().float()
    mean = vae.latents_mean.view(1, -1, 1, 1, 1).to(z.device, torch.float32)
    std = vae.latents_std.view(1, -1, 1, 1, 1).to(z.device, torch.float32)
    return (z - mean) * vae.config.scaling_factor / std


def pack_sound(latents: torch.Tensor) -> torch.Tensor:
    """Sound latents (B, C, L, M) -> tokens (B, L, C*M): what the DiT reads and the audio VAE's statistics
    normalise."""
    b, c, length, bins = latents.shape
    return latents.transpose(1, 2).reshape(b, length, c * bins)


def unpack_sound(tokens: torch.Tensor, bins: int) -> torch.Tensor:
    """The inverse of `pack_sound` for `bins` mel bins."""
    b, length, _ = tokens.shape
    return tokens.reshape(b, length, -1, bins).transpose(1, 2).contiguous()


def encode_audio(pipe, wave: torch.Tensor) -> torch.Tensor:
    """(B, 2, samples) at 16 kHz -> normalised audio latents (B, C, L, mel/4): the log-mel through the audio VAE's
    encoder, the posterior mode, normalised over the packed (channel x mel) features."""
    vae = pipe.audio_vae_encoder
    mel = log_mel(wave.to(pipe.device, torch.float32))
    z = vae.encode(mel.to(vae.dtype)).latent_dist.mode().float()
    packed = (pack_sound(z) - vae.latents_mean.to(z.device, torch.float32)) / vae.latents_std.to(z.device,
                                                                                                 torch.float32)
    return unpack_sound(packed, z.shape[-1])


def audio_latent_frames(num_frames: int, frame_rate: float) -> int:
    """Audio latents of a clip of `num_frames` at `frame_rate`: round(seconds * 25), the reference's and diffusers'."""
    return round(int(num_frames) / float(frame_rate) * 16000 / LATENT_HOP)


class LTX2ShapeChecker(PipelineUnit):
    """Height and width rounded up to multiples of 32, the frame count down to 8k + 1, and the clip's frame rate:
    the sample's own (a metadata column, a call's), else the run's --frame_rate."""

    inputs = ("height", "width", "num_frames", "frame_rate", "run_frame_rate")
    outputs = ("height", "width", "num_frames", "frame_rate")

    def process(self, pipe, height, width, num_frames, frame_rate, run_frame_rate):
        if height is None or width is None:
            raise UserError("height and width are required")
        f = pipe.stream.division
        frames = max(1, int(num_frames or 1))
        frames -= (frames - 1) % 8
        rate = float(frame_rate or run_frame_rate or pipe.stream.fps)
        return {"height": -(-int(height) // f) * f, "width": -(-int(width) // f) * f, "num_frames": frames,
                "frame_rate": rate}


class LTX2NoiseInitializer(PipelineUnit):
    """The clip's noise (C, F', H/32, W/32) and its sound's (C_a, L, 16) from one seed each (the reference draws both
    from `seed`), on `rand_device`."""

    inputs = ("height", "width", "num_frames", "frame_rate", "seed", "batch_size", "rand_device")
    outputs = ("noise", "audio_noise")
    models = ("video_vae_encoder", "audio_vae_encoder")  # their latent channels, where loaded (else the releases')

    def process(self, pipe, height, width, num_frames, frame_rate, seed, batch_size, rand_device):
        video, audio = pipe.target.streams
        device = rand_device or "cpu"
        noise = seeded_noise(video.noise_shape(pipe, height, width, num_frames), seed, batch_size, device=device)
        audio_noise = seeded_noise(audio.noise_shape(pipe, num_frames=num_frames, frame_rate=frame_rate), seed,
                                   batch_size, device=device)
        return {"noise": noise.to(pipe.device, pipe.torch_dtype), "audio_noise": audio_noise.to(pipe.device,
                                                                                              pipe.torch_dtype)}


class LTX2PromptEmbedder(PipelineUnit):
    """Gemma-3's hidden states of every layer (the prompt stripped, padded on the left to 1024 tokens), stacked and
    through the text connectors: one context for the video stream, one for the audio stream."""

    cfg_inputs = {"prompt": ("prompt", "negative_prompt")}
    cfg_outputs = {"video_context": ("video_context", "negative_video_context"),
                   "audio_context": ("audio_context", "negative_audio_context")}
    models = ("text_encoder", "text_encoder_post_modules")

    def process(self, pipe, prompt):
        if prompt is None:
            return {}
        from ...core.common_units import prompt_list

        tokenizer = getattr(pipe, "tokenizer", None)
        if tokenizer is None:
            raise UserError("no Gemma-3 tokenizer: pass --tokenizer_path (the Gemma-3 folder) to encode prompts")
        tokenizer.padding_side = "left"
        if tokenizer.pad_token is None:
            tokenizer.pad_token = tokenizer.eos_token
        tokens = tokenizer([p.strip() for p in prompt_list(prompt)], padding="max_length",
                           max_length=MAX_PROMPT_TOKENS, truncation=True, add_special_tokens=True, return_tensors="pt")
        ids, mask = tokens.input_ids.to(pipe.device), tokens.attention_mask.to(pipe.device)
        language = pipe.text_encoder.model.language_model
        states = language(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
        stacked = torch.stack(states, dim=-1).flatten(2, 3)
        connectors = pipe.text_encoder_post_modules
        video, audio, _ = connectors(stacked.to(connectors.dtype), mask, padding_side="left")
        return {"video_context": video.to(pipe.torch_dtype), "audio_context": audio.to(pipe.torch_dtype)}


class LTX2VideoEmbedder(PipelineUnit):
    """The clip's clean latents in training; sampling starts from the noise."""

    inputs = ("input_video", "noise", "height", "width")
    outputs = ("latents", "input_latents")
    models = ("video_vae_encoder",)

    def process(self, pipe, input_video, noise, height, width):
        if input_video is None or not pipe.scheduler.training:
            return {"latents": noise}
        clips = input_video if input_video and isinstance(input_video[0], (list, tuple)) else [input_video]
        latents = torch.cat([encode_video(pipe, video_tensor(c, height, width)) for c in clips])
        return {"latents": noise, "input_latents": latents.to(pipe.torch_dtype)}


class LTX2AudioEmbedder(PipelineUnit):
    """The sound's clean latents in training, the sound first made as long as its clip (num_frames at the frame
    rate: cut, or padded with silence with a note naming the file); a clip without sound has none and trains the
    video stream alone. Sampling starts from the noise."""

    inputs = ("input_audio", "audio_noise", "num_frames", "frame_rate")
    outputs = ("audio_latents", "audio_input_latents")
    models = ("audio_vae_encoder",)

    def process(self, pipe, input_audio, audio_noise, num_frames, frame_rate):
        waves = input_audio if isinstance(input_audio, list) else [input_audio]
        if input_audio is None or any(w is None for w in waves) or not pipe.scheduler.training:
            return {"audio_latents": audio_noise}
        latents = []
        for wave in waves:
            samples = aligned_samples(num_frames, float(frame_rate))
            where = getattr(wave, "source", None) or "a clip's sound"
            latents.append(encode_audio(pipe, align(wave, samples, where)[None]))
        return {"audio_latents": audio_noise, "audio_input_latents": torch.cat(latents).to(pipe.torch_dtype)}


UNITS = (LTX2ShapeChecker, LTX2NoiseInitializer, LTX2PromptEmbedder, LTX2VideoEmbedder, LTX2AudioEmbedder)

__all__ = ["LTX2AudioEmbedder", "LTX2NoiseInitializer", "LTX2PromptEmbedder", "LTX2ShapeChecker",
           "LTX2VideoEmbedder", "MAX_PROMPT_TOKENS", "UNITS", "pack_sound", "unpack_sound", "audio_latent_frames", "encode_audio", "encode_video",
           "video_tensor"]
