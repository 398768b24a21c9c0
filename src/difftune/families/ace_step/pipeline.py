"""`AceStepPipeline`: ACE-Step 1.5 text-to-music (its nine DiTs: turbo, base, sft, the turbo shift variants, XL):
its audio target, units, denoiser call and sampling schedule.

The DiT is diffusers' `AceStepTransformer1DModel`: the noisy latents (B, frames, 64) beside the context latents
(B, frames, 128), the condition encoder's packed states as cross-attention, the time in [0, 1] for `t` and `r`
alike (the reference passes its 0..1000 timestep to an embedding of scale 1, diffusers the 0..1 one to an embedding
of scale 1000: the same sinusoid). It predicts the flow (noise - x0)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ...core.batch import SAME
from ...core.checkpointing import set_gradient_checkpointing
from ...core.options import sample_input
from ...core.pipeline import BasePipeline
from ...core.target import AudioStream, Target
from ...errors import UserError, row_label
from .components import HOP, LATENT_CHANNELS, SAMPLE_RATE
from .units import UNITS, frames_of

# The reference's sampling defaults (turbo: 8 steps, no guidance; base / sft take --cfg_scale and more steps)
CALL_DEFAULTS = {"num_inference_steps": 8, "cfg_scale": 1.0}
CALL_PARAMETERS = {"lyrics": "", "duration": 60, "bpm": 100, "keyscale": "B minor", "timesignature": "4",
                   "vocal_language": "unknown", "input_audio": None}
# The ACE-Step schedule: linspace(1, 0, N + 1)[:-1] shifted by 3, for training (N = 1000) and sampling alike
SCHEDULER_CONFIG = {"num_train_timesteps": 1000, "shift": 3.0, "use_dynamic_shifting": False}
PEAK = 10 ** (-1 / 20)  # outputs are normalised to a peak of -1 dBFS, as the reference and diffusers do


def _decode(pipe, latents):
    """(B, frames, 64) -> (B, 2, samples), each clip scaled to a -1 dBFS peak."""
    vae = pipe.vae
    dtype = next(vae.parameters()).dtype
    audio = vae.decode(latents.transpose(1, 2).to(pipe.device, dtype)).sample.float()
    peak = audio.abs().amax(dim=(1, 2), keepdim=True)
    return torch.where(peak > 1e-6, audio * (PEAK / peak.clamp(min=1e-6)), audio)


@dataclass(frozen=True, eq=False)
class AceStepAudio(AudioStream):
    """48 kHz stereo music; latents (frames, 64) channels last, a frame per 1920 samples; a clip's length is its
    whole seconds (`duration`, as the reference takes it from the file)."""

    channels: int = LATENT_CHANNELS
    scale: int = HOP
    sample_rate: int = SAMPLE_RATE
    audio_channels: int = 2
    default_seconds: float = 60.0

    def seq_len(self, latents):
        return int(latents.shape[-2])

    def size_seq_len(self, values):
        return frames_of(values.get("duration") or self.default_seconds)

    def noise_shape(self, pipe, duration=None, seconds=None, **_):
        frames = frames_of(duration if duration is not None else seconds if seconds is not None
                           else self.default_seconds)
        return (frames, self.latent_channels(pipe))

    def latent_channels(self, pipe) -> int:
        """The DiT's output channels (64 in every release; a smaller test model says its own)."""
        models = getattr(pipe, "models", {}) or {}
        for slot, key in (("dit", "audio_acoustic_hidden_dim"), ("vae", "decoder_input_channels")):
            value = getattr(getattr(models.get(slot), "config", None), key, None)
            if value:
                return int(value)
        return self.channels

    def size_of(self, pipe, latents):
        return {"duration": int(latents.shape[-2]) * self.scale / self.sample_rate}

    def row_size(self, value):
        return {"duration": math.floor(value.shape[-1] / self.sample_rate)} if value is not None else {}

    def operator(self, size, frames=None):
        from ...data.audio import audio_clip_operator

        return audio_clip_operator(size["base_path"], self.sample_rate, self.audio_channels)


class AceStepPipeline(BasePipeline):
    model_names = ("dit", "conditioner", "text_encoder", "vae")
    loss_models = ("dit",)
    settings = frozenset({"batch_size", "rand_device", "use_gradient_checkpointing",
                          "use_gradient_checkpointing_offload"})
    model_fn_inputs = ("encoder_hidden_states", "encoder_attention_mask", "context_latents")
    padding_masks = ("encoder_attention_mask",)
    data_inputs = ("audio", "prompt", "lyrics", "bpm", "keyscale", "timesignature", "vocal_language", "seed",
                   "rand_device")
    input_batching = {"duration": SAME, "rand_device": SAME}
    batch_shared_inputs = ("duration", "rand_device")
    # each sample's caption and lyrics are tokenized alone (the reference's batch of one): no padding in stage 1
    encode_alone = True
    call_defaults = CALL_DEFAULTS
    call_parameters = CALL_PARAMETERS
    sample_flags = {
        "lyrics": sample_input("ACE-Step: the lyrics (with [verse] / [chorus] tags; [Instrumental] for none)."),
        "duration": sample_input("ACE-Step: seconds of music (default 60).", kind=float),
        "bpm": sample_input("ACE-Step: tempo in beats per minute (default 100).", kind=int),
        "keyscale": sample_input("ACE-Step: key and scale, e.g. 'C major' (default 'B minor')."),
        "timesignature": sample_input("ACE-Step: beats per bar (default 4)."),
        "vocal_language": sample_input("ACE-Step: the lyrics' language code, e.g. en (default unknown)."),
    }
    target = Target((AceStepAudio(decoder=_decode),))
    scheduler_config = SCHEDULER_CONFIG
    base_units = UNITS

    def training_inputs(self, data):
        if "lyrics" not in data:
            raise UserError(f"{row_label(data)}: no 'lyrics' column: ACE-Step trains on each clip's lyrics "
                            f"(write [Instrumental] for music without vocals)")
        return super().training_inputs(data)

    @classmethod
    def data_operators(cls, config) -> dict:
        """The clips: 48 kHz stereo, cut to --max_audio_duration and to whole seconds."""
        from ...data.audio import audio_clip_operator

        options = getattr(config, "family_options", None)
        most = getattr(options, "max_audio_duration", None)
        stream = cls.target.primary
        return {**super().data_operators(config),
                stream.column: audio_clip_operator(config.dataset_base_path, stream.sample_rate,
                                                   stream.audio_channels, max_seconds=most,
                                                   max_flag="--max_audio_duration")}

    def set_timesteps(self, values, num_inference_steps: int, denoising_strength: float = 1.0) -> None:
        """linspace(strength, 0, N + 1)[:-1] shifted by 3 (the reference's and diffusers' schedule)."""
        self.scheduler.set_timesteps(num_inference_steps, denoising_strength=denoising_strength,
                                     strength_mode="diffsynth")

    def negative_name(self, name: str) -> str:
        return "negative_encoder_hidden_states" if name == "encoder_hidden_states" else name

    def model_fn(self, latents, timestep, encoder_hidden_states, context_latents, encoder_attention_mask=None,
                 use_gradient_checkpointing=False, use_gradient_checkpointing_offload=False, **_):
        dit = self.dit
        if dit is None:
            raise UserError("no ACE-Step DiT loaded")
        dtype = next(dit.parameters()).dtype
        b = latents.shape[0]
        t = (timestep.to(latents.device, torch.float32).reshape(-1).expand(b) / 1000).to(dtype)
        set_gradient_checkpointing(dit, use_gradient_checkpointing, use_gradient_checkpointing_offload)
        states = encoder_hidden_states.to(latents.device, dtype)
        context = context_latents.to(latents.device, dtype)
        x = latents.to(dtype)

        def run(i):  # the DiT's cross-attention takes no mask: a padded sample runs on its own tokens
            n = int(encoder_attention_mask[i].sum()) if encoder_attention_mask is not None else states.shape[1]
            return dit(hidden_states=x[i:i + 1], timestep=t[i:i + 1], timestep_r=t[i:i + 1],
                       encoder_hidden_states=states[i:i + 1, :n], context_latents=context[i:i + 1],
                       return_dict=False)[0]

        if encoder_attention_mask is None or bool(encoder_attention_mask.all()):
            out = dit(hidden_states=x, timestep=t, timestep_r=t, encoder_hidden_states=states,
                      context_latents=context, return_dict=False)[0]
        else:
            out = torch.cat([run(i) for i in range(b)])
        return out.to(latents.dtype)


__all__ = ["AceStepAudio", "AceStepPipeline", "CALL_DEFAULTS", "CALL_PARAMETERS", "SCHEDULER_CONFIG"]
