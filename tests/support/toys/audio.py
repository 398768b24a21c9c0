"""`toy_audio`: a family that generates audio. A tiny audio VAE (waveform (1, T) at 8 kHz -> latents (4, T / 4) and
back), a byte-level prompt encoder and a sequence denoiser; wav in (the `audio` column), wav out."""

from __future__ import annotations

import torch

from difftune import BasePipeline, FamilySpec, PipelineUnit, register_family
from difftune.core.batch import SAME
from difftune.core.target import AudioStream, Target
from support import TinyFamily, register_tiny

from .common import AudioVAE, PromptUnit, SeqDenoiser, TextEncoder, components, save_models, seeded, tone

RATE, STEP, SECONDS = 8000, 4, 0.25  # 2000 samples, 500 latent steps


class ToyAudioVAE(AudioVAE):
    pass


class ToyAudioDenoiser(SeqDenoiser):
    pass


class ToyAudioTextEncoder(TextEncoder):
    pass


def decode(pipe, latents):
    return pipe.vae.decode(latents.to(pipe.torch_dtype))


class AudioNoise(PipelineUnit):
    inputs = ("seconds", "seed", "batch_size")
    outputs = ("noise",)

    def process(self, pipe, seconds, seed, batch_size):
        return {"noise": seeded((batch_size or 1, *pipe.stream.noise_shape(pipe, seconds=seconds)), seed, pipe)}


class AudioEncoder(PipelineUnit):
    inputs = ("input_audio", "noise")
    outputs = ("latents", "input_latents")
    models = ("vae",)

    def process(self, pipe, input_audio, noise):
        if input_audio is None:
            return {"latents": noise}
        wave = torch.stack(input_audio) if isinstance(input_audio, list) else input_audio
        wave = wave[None] if wave.dim() == 2 else wave
        return {"latents": noise, "input_latents": pipe.vae.encode(wave.to(pipe.device, pipe.torch_dtype))}


class ToyAudioPipeline(BasePipeline):
    model_names = ("dit", "text_encoder", "vae")
    loss_models = ("dit",)
    settings = frozenset({"batch_size", "use_gradient_checkpointing", "use_gradient_checkpointing_offload"})
    model_fn_inputs = ("prompt_emb",)
    data_inputs = ("audio", "prompt", "seed")
    input_batching = {"seconds": SAME}
    batch_shared_inputs = ("seconds",)
    call_defaults = {"num_inference_steps": 4, "cfg_scale": 1.0}
    call_parameters = {"seconds": SECONDS, "input_audio": None}
    target = Target((AudioStream(channels=4, scale=STEP, sample_rate=RATE, default_seconds=SECONDS,
                                 decoder=decode),))
    scheduler_config = {"shift": 3.0}
    base_units = (AudioNoise, AudioEncoder, PromptUnit)

    def model_fn(self, latents, timestep, prompt_emb, use_gradient_checkpointing=False,
                 use_gradient_checkpointing_offload=False, **_):
        (out,) = self.dit.run([latents.transpose(1, 2)], timestep, prompt_emb, use_gradient_checkpointing,
                              use_gradient_checkpointing_offload)
        return out.transpose(1, 2)


CLASSES = {"dit": ToyAudioDenoiser, "text_encoder": ToyAudioTextEncoder, "vae": ToyAudioVAE}
FAMILY = register_family(FamilySpec(name="toy_audio", pipeline=ToyAudioPipeline,
                                    components=components(__name__, CLASSES), lora_prefixes={"dit": "transformer"},
                                    lora_target_modules="modulation,mlp"))


def write_dataset(root, n: int = 2):
    from difftune.media.audio import write_audio

    root.mkdir(parents=True, exist_ok=True)
    rows = ["audio,prompt"]
    for i in range(n):
        write_audio(tone(SECONDS, RATE, 220 * (i + 1), seed=i), root / f"tone{i}.wav", RATE)
        rows.append(f"tone{i}.wav,a tone of {220 * (i + 1)} hertz")
    (root / "metadata.csv").write_text("\n".join(rows) + "\n")
    return root / "metadata.csv"


def _tiny(folder):
    return TinyFamily(model_paths=save_models(folder, CLASSES), lora_base_model="dit", lora_target_modules="mlp",
                      write_dataset=write_dataset, flags=("--data_file_keys", "audio"),
                      trainable_cases={"text_encoder_lora": ("--lora_base_model", "text_encoder",
                                                             "--lora_target_modules", "proj")},
                      call_args={"seconds": SECONDS})


register_tiny("toy_audio", _tiny)
