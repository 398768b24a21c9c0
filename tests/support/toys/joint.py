"""`toy_av`: a family that generates a clip with its sound track: two streams (video latents (4, F, H/4, W/4) and
audio latents (4, T/4) at 8 kHz), one loss each, one denoiser over both token sequences, an mp4 with sound out."""

from __future__ import annotations

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn

from difftune import BasePipeline, FamilySpec, PipelineUnit, register_family
from difftune.core.batch import SAME
from difftune.core.target import AudioStream, FrameRule, Target, VideoStream
from difftune.media.image import images_to_tensor
from support import TinyFamily, register_tiny

from .common import AudioVAE, PromptUnit, SeqDenoiser, TextEncoder, components, save_models, seeded, tone

RATE, STEP, FPS, PATCH, FRAMES = 8000, 4, 16.0, 4, 3


class ToyAVVideoVAE(ModelMixin, ConfigMixin):
    @register_to_config
    def __init__(self, channels: int = 4):
        super().__init__()
        self.encoder = nn.Conv3d(3, channels, (1, PATCH, PATCH), stride=(1, PATCH, PATCH))

    def encode(self, video):
        return self.encoder(video)

    def decode(self, latents):  # a preview: the first three channels, upsampled
        return torch.nn.functional.interpolate(latents[:, :3].float(), scale_factor=(1, PATCH, PATCH)).tanh()


class ToyAVAudioVAE(AudioVAE):
    pass


class ToyAVDenoiser(SeqDenoiser):
    pass


class ToyAVTextEncoder(TextEncoder):
    pass


class Noise(PipelineUnit):
    inputs = ("height", "width", "num_frames", "seed", "batch_size")
    outputs = ("noise", "audio_noise")

    def process(self, pipe, height, width, num_frames, seed, batch_size):
        video, audio = pipe.target.streams
        n = batch_size or 1
        noise = seeded((n, *video.noise_shape(pipe, height, width, num_frames)), seed, pipe)
        audio_noise = seeded((n, *audio.noise_shape(pipe, num_frames=num_frames)), None if seed is None else seed + 1,
                             pipe)
        return {"noise": noise, "audio_noise": audio_noise}


class Encoder(PipelineUnit):
    inputs = ("input_video", "input_audio", "noise", "audio_noise", "height", "width")
    outputs = ("latents", "input_latents", "audio_latents", "audio_input_latents")
    models = ("vae", "audio_vae")

    def process(self, pipe, input_video, input_audio, noise, audio_noise, height, width):
        out = {"latents": noise, "audio_latents": audio_noise}
        if input_video is None:
            return out
        clips = input_video if isinstance(input_video[0], list) else [input_video]
        video = torch.stack([images_to_tensor(c, height, width).transpose(0, 1) for c in clips])
        wave = torch.stack(input_audio) if isinstance(input_audio, list) else input_audio[None]
        out["input_latents"] = pipe.vae.encode(video.to(pipe.device, pipe.torch_dtype))
        out["audio_input_latents"] = pipe.audio_vae.encode(wave.to(pipe.device, pipe.torch_dtype))
        return out


class ToyAVPipeline(BasePipeline):
    model_names = ("dit", "text_encoder", "vae", "audio_vae")
    loss_models = ("dit",)
    settings = frozenset({"batch_size", "use_gradient_checkpointing", "use_gradient_checkpointing_offload"})
    model_fn_inputs = ("prompt_emb",)
    data_inputs = ("video", "audio", "prompt", "seed")
    input_batching = {"height": SAME, "width": SAME, "num_frames": SAME}
    batch_shared_inputs = ("height", "width", "num_frames")
    call_defaults = {"height": 32, "width": 32, "num_frames": FRAMES, "num_inference_steps": 4, "cfg_scale": 1.0}
    call_parameters = {"num_frames": FRAMES}
    target = Target((
        VideoStream(channels=4, scale=PATCH, division=PATCH, temporal=1, frames=FrameRule(FRAMES),
                    decoder=lambda pipe, latents: pipe.vae.decode(latents), fps=FPS),
        AudioStream(column="audio", input="input_audio", latents="audio_latents",
                    input_latents="audio_input_latents", channels=4, scale=STEP, sample_rate=RATE, fps=FPS,
                    decoder=lambda pipe, latents: pipe.audio_vae.decode(latents), decode_models=("audio_vae",))))
    scheduler_config = {"shift": 3.0}
    base_units = (Noise, Encoder, PromptUnit)

    def model_fn(self, latents, audio_latents, timestep, prompt_emb, use_gradient_checkpointing=False,
                 use_gradient_checkpointing_offload=False, **_):
        b, c, f, h, w = latents.shape
        video, audio = self.dit.run([latents.flatten(2).transpose(1, 2), audio_latents.transpose(1, 2)], timestep,
                                    prompt_emb, use_gradient_checkpointing, use_gradient_checkpointing_offload)
        return {"video": video.transpose(1, 2).reshape(b, c, f, h, w), "audio": audio.transpose(1, 2)}


CLASSES = {"dit": ToyAVDenoiser, "text_encoder": ToyAVTextEncoder, "vae": ToyAVVideoVAE,
           "audio_vae": ToyAVAudioVAE}
FAMILY = register_family(FamilySpec(name="toy_av", pipeline=ToyAVPipeline, components=components(__name__, CLASSES),
                                    lora_prefixes={"dit": "transformer"}, lora_target_modules="modulation,mlp"))


def write_dataset(root, n: int = 2):
    """Clips of FRAMES frames at FPS, each with its sound track muxed in (the audio column names the same file)."""
    from PIL import Image

    from difftune.media.video import write_video

    root.mkdir(parents=True, exist_ok=True)
    rows = ["video,audio,prompt"]
    for i in range(n):
        frames = [Image.new("RGB", (32, 24), (60 * i + 40 * t, 90, 200 - 50 * t)) for t in range(FRAMES)]
        write_video(frames, root / f"clip{i}.mp4", fps=FPS, audio=(tone(1.0, RATE, 330 * (i + 1), seed=i), RATE))
        rows.append(f"clip{i}.mp4,clip{i}.mp4,a clip with a tone of {330 * (i + 1)} hertz")
    (root / "metadata.csv").write_text("\n".join(rows) + "\n")
    return root / "metadata.csv"


def _tiny(folder):
    models = {**CLASSES, "dit": lambda: ToyAVDenoiser(channels=(4, 4))}  # one projection pair per stream
    return TinyFamily(model_paths=save_models(folder, models), lora_base_model="dit", lora_target_modules="mlp",
                      write_dataset=write_dataset, flags=("--data_file_keys", "video,audio"),
                      call_args={"height": 32, "width": 32, "num_frames": FRAMES})


register_tiny("toy_av", _tiny)
