"""ACE-Step's units, as the reference's (`diffsynth/pipelines/ace_step.py`, text2music): the caption in its
instruction / caption / metas template through Qwen3-Embedding (256 tokens) and the lyrics in theirs through the
embedding table alone (2048 tokens); the condition encoder over them and 30 s of the silence latent (no reference
audio: the timbre of silence); the context latents (the silence latent cut to the clip's frames beside an all-ones
chunk mask); the noise; the clip's latents.

Latents are (frames, 64) per sample, channels last, 25 frames a second: the layout the DiT takes and the reference
draws its noise in."""

from __future__ import annotations

import torch

from ...core.batch import Pad
from ...core.units import PipelineUnit
from ...errors import UserError
from .components import HOP, SAMPLE_RATE

SFT_GEN_PROMPT = "# Instruction\n{}\n\n# Caption\n{}\n\n# Metas\n{}<|endoftext|>\n"
TEXT2MUSIC = "Fill the audio semantic mask based on the given conditions:"
LYRIC_PROMPT = "# Languages\n{}\n\n# Lyric\n{}<|endoftext|>"
CAPTION_TOKENS, LYRIC_TOKENS = 256, 2048
TIMBRE_FRAMES = 750  # 30 s of latent frames: the silence the timbre encoder sees without a reference clip
# The reference's training defaults for the optional metadata columns
METADATA_DEFAULTS = {"bpm": 100, "keyscale": "C major", "timesignature": "4", "vocal_language": "unknown"}


def frames_of(duration) -> int:
    """Latent frames of a clip of `duration` seconds (the reference's round(duration * 48000 / 1920))."""
    return int(round(float(duration) * SAMPLE_RATE / HOP))


def metas(bpm, timesignature, keyscale, duration) -> str:
    return (f"- bpm: {bpm}\n- timesignature: {timesignature}\n- keyscale: {keyscale}\n"
            f"- duration: {int(duration)} seconds\n")


def _per_sample(value, n: int) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value] * n


def _text(value, default):
    """A metadata cell: its text, or the default for an empty one (a blank CSV cell, JSON null)."""
    if value is None or (isinstance(value, float) and value != value) or (isinstance(value, str) and not value.strip()):
        return default
    return value


def silence(pipe, frames: int) -> torch.Tensor:
    """The silence latent's first `frames` frames (repeated where the clip is longer than it), (frames, 64)."""
    latent = getattr(pipe, "silence_latent", None)
    if latent is None:
        raise UserError("no silence latent loaded: pass --silence_latent_path (the release's "
                        "acestep-v15-turbo/silence_latent.pt)")
    latent = latent[0]
    if frames > latent.shape[0]:
        latent = latent.repeat(-(-frames // latent.shape[0]), 1)
    return latent[:frames].to(pipe.device, pipe.torch_dtype)


class AceStepPromptEmbedder(PipelineUnit):
    """Caption + metas through the text encoder; lyrics through its embedding table."""

    inputs = ("prompt", "lyrics", "duration", "bpm", "keyscale", "timesignature", "vocal_language")
    outputs = ("text_hidden_states", "text_attention_mask", "lyric_hidden_states", "lyric_attention_mask")
    models = ("text_encoder",)
    batching = {"text_hidden_states": Pad("text_attention_mask"), "lyric_hidden_states": Pad("lyric_attention_mask")}

    def process(self, pipe, prompt, lyrics, duration, bpm, keyscale, timesignature, vocal_language):
        if prompt is None:
            return {}
        prompts = [prompt] if isinstance(prompt, str) else list(prompt)
        n = len(prompts)
        meta = {k: _per_sample(v, n) for k, v in (("lyrics", lyrics), ("duration", duration), ("bpm", bpm),
                                                   ("keyscale", keyscale), ("timesignature", timesignature),
                                                   ("vocal_language", vocal_language))}
        given = [{k: _text(meta[k][i], d) for k, d in METADATA_DEFAULTS.items()} for i in range(n)]
        captions = [SFT_GEN_PROMPT.format(TEXT2MUSIC, p, metas(g["bpm"], g["timesignature"], g["keyscale"],
                                                               meta["duration"][i]))
                    for i, (p, g) in enumerate(zip(prompts, given))]
        songs = [LYRIC_PROMPT.format(g["vocal_language"], _text(meta["lyrics"][i], "")) for i, g in enumerate(given)]
        text, text_mask = self._tokens(pipe, captions, CAPTION_TOKENS)
        words, words_mask = self._tokens(pipe, songs, LYRIC_TOKENS)
        encoder = pipe.text_encoder
        dtype = pipe.torch_dtype
        text_states = encoder(input_ids=text, attention_mask=text_mask).last_hidden_state
        lyric_states = encoder.get_input_embeddings()(words)
        return {"text_hidden_states": text_states.to(dtype), "text_attention_mask": text_mask.bool(),
                "lyric_hidden_states": lyric_states.to(dtype), "lyric_attention_mask": words_mask.bool()}

    @staticmethod
    def _tokens(pipe, texts, limit):
        tokenizer = pipe.tokenizer
        if tokenizer is None:
            raise UserError("no tokenizer loaded: pass --tokenizer_path (Qwen3-Embedding-0.6B/)")
        batch = tokenizer(texts, max_length=limit, truncation=True, padding="longest", return_tensors="pt")
        return batch.input_ids.to(pipe.device), batch.attention_mask.to(pipe.device)


class AceStepConditionEmbedder(PipelineUnit):
    """Text, lyrics and the timbre of 30 s of silence through the condition encoder -> the DiT's cross-attention
    states and their mask; the negative side (guidance) is the learned null condition, as the reference's."""

    inputs = ("text_hidden_states", "text_attention_mask", "lyric_hidden_states", "lyric_attention_mask")
    outputs = ("encoder_hidden_states", "encoder_attention_mask", "negative_encoder_hidden_states")
    models = ("conditioner",)
    batching = {"encoder_hidden_states": Pad("encoder_attention_mask"),
                "negative_encoder_hidden_states": Pad("encoder_attention_mask")}
    skip_without = ("text_hidden_states",)

    def process(self, pipe, text_hidden_states, text_attention_mask, lyric_hidden_states, lyric_attention_mask):
        n = text_hidden_states.shape[0]
        timbre = silence(pipe, TIMBRE_FRAMES)[None].expand(n, -1, -1)
        order = torch.arange(n, device=pipe.device, dtype=torch.long)
        conditioner = pipe.conditioner
        states, mask = conditioner(text_hidden_states=text_hidden_states, text_attention_mask=text_attention_mask,
                                   lyric_hidden_states=lyric_hidden_states, lyric_attention_mask=lyric_attention_mask,
                                   refer_audio_acoustic_hidden_states_packed=timbre, refer_audio_order_mask=order)
        null = conditioner.null_condition_emb.to(states.dtype).expand_as(states)
        return {"encoder_hidden_states": states, "encoder_attention_mask": mask.bool(),
                "negative_encoder_hidden_states": null}


class AceStepContextBuilder(PipelineUnit):
    """The context the DiT sees beside the noisy latents: the silence latent over the clip's frames and an
    all-ones chunk mask (text2music: nothing of a source clip is kept), (frames, 128)."""

    inputs = ("duration", "batch_size")
    outputs = ("context_latents",)
    # the silence latent comes with the condition encoder (the release keeps it beside that file): a stage that
    # builds the context loads it
    models = ("conditioner",)

    def process(self, pipe, duration, batch_size):
        durations = _per_sample(duration, batch_size or 1)
        frames = {frames_of(d) for d in durations}
        if len(frames) > 1:
            raise UserError(f"cannot batch clips of different lengths ({sorted(frames)} latent frames)")
        frames = frames.pop()
        if frames < 1:
            raise UserError(f"duration {durations[0]} s is shorter than one latent frame ({HOP / SAMPLE_RATE} s)")
        src = silence(pipe, frames)
        context = torch.cat([src, torch.ones_like(src)], dim=-1)
        return {"context_latents": context[None].expand(len(durations), -1, -1).contiguous()}


class AceStepNoiseInitializer(PipelineUnit):
    """Seeded noise of the clip's latent shape: the context's frames, half its channels (the reference's)."""

    inputs = ("context_latents", "seed", "rand_device")
    outputs = ("latents",)

    def process(self, pipe, context_latents, seed, rand_device):
        from ...core.latents import seeded_noise

        n, frames, channels = context_latents.shape
        noise = seeded_noise((frames, channels // 2), seed, n, rand_device or "cpu")
        return {"latents": noise.to(pipe.device, pipe.torch_dtype)}


class AceStepAudioEncoder(PipelineUnit):
    """The clip through the VAE (the posterior's mean) -> (frames, 64), cut or zero-padded to the clip's whole
    seconds as the reference crops them."""

    inputs = ("input_audio", "duration")
    outputs = ("input_latents",)
    models = ("vae",)
    skip_without = ("input_audio",)

    def process(self, pipe, input_audio, duration):
        waves = input_audio if isinstance(input_audio, (list, tuple)) else [input_audio]
        waves = [w[None] if w.dim() == 2 else w for w in waves]
        wave = torch.cat(waves).clamp(-1, 1).to(pipe.device, pipe.torch_dtype)
        latents = pipe.vae.encode(wave).latent_dist.mean.transpose(1, 2)
        frames = frames_of(_per_sample(duration, len(waves))[0])
        latents = latents[:, :frames]
        if latents.shape[1] < frames:
            latents = torch.nn.functional.pad(latents, (0, 0, 0, frames - latents.shape[1]))
        return {"input_latents": latents}


UNITS = (AceStepPromptEmbedder, AceStepConditionEmbedder, AceStepContextBuilder, AceStepNoiseInitializer,
         AceStepAudioEncoder)

__all__ = ["AceStepAudioEncoder", "AceStepConditionEmbedder", "AceStepContextBuilder", "AceStepNoiseInitializer",
           "AceStepPromptEmbedder", "METADATA_DEFAULTS", "UNITS", "frames_of", "silence"]
