"""LTX-2 / LTX-2.3 key names: the official (Lightricks) layout <-> diffusers', for every part, both ways.

The official single file (`ltx-2-19b-dev.safetensors`, `ltx-2.3-22b-dev.safetensors`, JoyAI-Echo's
`JoyAI-Echo-release.safetensors`) keeps every part under its own prefix: `model.diffusion_model.*` the DiT (with the
two text connectors inside it: `video_embeddings_connector.*`, `audio_embeddings_connector.*`),
`text_embedding_projection.*` the Gemma feature projection, `vae.*` the video VAE, `audio_vae.*` the audio VAE,
`vocoder.*` the vocoder. DiffSynth-Studio's `*-Repackage` repositories split it into seven files (`REPACKAGE_FILES`,
`split_single_file`), each still in the official names.

The diffusers classes: `LTX2VideoTransformer3DModel` (the DiT), `LTX2TextConnectors` (the projection and both
connectors), `AutoencoderKLLTX2Video`, `AutoencoderKLLTX2Audio`, `LTX2Vocoder` (2.0) / `LTX2VocoderWithBWE` (2.3).

Every function here maps a state dict (name -> tensor) to a new dict with the same tensor objects under new names:
values are never read, so meta tensors and shape-only stand-ins work. `*_to_diffusers` takes the names a file has
(its part's prefix; the DiT's may be left off) and `*_to_original` gives them back; a key the official file has and
diffusers has no place for is dropped (`DROPPED_ORIGINAL_KEYS`), any other key is renamed by the part's rules and
passed on, so a strict load reports it.

Where diffusers 0.42 converts (`diffusers.loaders.single_file_utils.convert_ltx2_*_to_diffusers`: the DiT and both
VAEs) its converter is used (on a copy: it pops its input), then what it misses for LTX-2.3 is renamed after it: the
DiT's `prompt_adaln_single` / `audio_prompt_adaln_single` (diffusers: `prompt_adaln`, `audio_prompt_adaln`), the 2.3
video decoder's ninth and tenth blocks (`up_blocks.7`, `up_blocks.8`: its fourth upsampler and up block) and a
timestep-conditioned decoder's `last_time_embedder` / `last_scale_shift_table`. The connectors and the vocoder have
no converter in diffusers' package; their renames are those of diffusers' repository script
`scripts/convert_ltx2_to_diffusers.py` (`LTX_2_*_CONNECTORS_KEYS_RENAME_DICT`, `LTX_2_*_VOCODER_RENAME_DICT`), here as
whole dotted segments so that `ups` never touches `upsample`.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

DIT_PREFIX = "model.diffusion_model."
TEXT_PROJECTION_PREFIX = "text_embedding_projection."
VIDEO_VAE_PREFIX = "vae."
AUDIO_VAE_PREFIX = "audio_vae."
VOCODER_PREFIX = "vocoder."
CONNECTOR_MODULES = ("video_embeddings_connector.", "audio_embeddings_connector.")

# The official file's keys diffusers has no tensor for: the video VAE's per-channel statistics beyond the two it
# keeps (`mean-of-means` -> `latents_mean`, `std-of-means` -> `latents_std`). Both Repackage VAE files carry them.
DROPPED_VIDEO_VAE_STATISTICS = ("channel", "mean-of-stds", "mean-of-stds_over_std-of-means")
DROPPED_ORIGINAL_KEYS = frozenset(f"{VIDEO_VAE_PREFIX}per_channel_statistics.{name}"
                                  for name in DROPPED_VIDEO_VAE_STATISTICS)

# DiffSynth-Studio/LTX-2-Repackage and LTX-2.3-Repackage: file name -> the official prefixes it holds
REPACKAGE_FILES = {
    "transformer.safetensors": (DIT_PREFIX,),  # without the two connectors
    "text_encoder_post_modules.safetensors": (TEXT_PROJECTION_PREFIX,) + tuple(DIT_PREFIX + m for m in CONNECTOR_MODULES),
    "video_vae_encoder.safetensors": ("vae.encoder.", "vae.per_channel_statistics."),
    "video_vae_decoder.safetensors": ("vae.decoder.", "vae.per_channel_statistics."),
    "audio_vae_encoder.safetensors": ("audio_vae.encoder.", "audio_vae.per_channel_statistics."),
    "audio_vae_decoder.safetensors": ("audio_vae.decoder.", "audio_vae.per_channel_statistics."),
    "audio_vocoder.safetensors": (VOCODER_PREFIX,),
}
# ... and the official single files
OFFICIAL_FILES = {"2": "ltx-2-19b-dev.safetensors", "2.3": "ltx-2.3-22b-dev.safetensors"}
JOYAI_ECHO_FILE = "JoyAI-Echo-release.safetensors"


def _is_connector(key: str) -> bool:
    return key.removeprefix(DIT_PREFIX).startswith(CONNECTOR_MODULES)


def split_single_file(state: Mapping[str, object]) -> dict[str, dict]:
    """An official single file's tensors as the seven Repackage files hold them (file name -> state dict; the video
    and audio statistics go into both files of their VAE). A key of no part is left out: `unassigned_keys`."""
    parts: dict[str, dict] = {name: {} for name in REPACKAGE_FILES}
    for key, value in state.items():
        for name, prefixes in REPACKAGE_FILES.items():
            if name == "transformer.safetensors" and _is_connector(key):
                continue
            if key.startswith(prefixes):
                parts[name][key] = value
    return parts


def unassigned_keys(state: Mapping[str, object]) -> list[str]:
    """The keys of an official single file that no Repackage file takes."""
    every = tuple(p for prefixes in REPACKAGE_FILES.values() for p in prefixes)
    return sorted(k for k in state if not k.startswith(every))


def _segments(key: str, table: Mapping[str, str]) -> str:
    return ".".join(table.get(s, s) for s in key.split("."))


def _invert(table: Mapping[str, str]) -> dict[str, str]:
    inverse = {v: k for k, v in table.items()}
    assert len(inverse) == len(table), "a rename table must be one to one"
    return inverse


# -- the DiT -----------------------------------------------------------------------------------------------------

# official -> diffusers, whole segments (diffusers' converter does these as substrings, plus the two time embeddings)
DIT_SEGMENTS = {
    "patchify_proj": "proj_in",
    "audio_patchify_proj": "audio_proj_in",
    "adaln_single": "time_embed",
    "audio_adaln_single": "audio_time_embed",
    "prompt_adaln_single": "prompt_adaln",  # LTX-2.3 (cross-attention AdaLN)
    "audio_prompt_adaln_single": "audio_prompt_adaln",
    "av_ca_video_scale_shift_adaln_single": "av_cross_attn_video_scale_shift",
    "av_ca_a2v_gate_adaln_single": "av_cross_attn_video_a2v_gate",
    "av_ca_audio_scale_shift_adaln_single": "av_cross_attn_audio_scale_shift",
    "av_ca_v2a_gate_adaln_single": "av_cross_attn_audio_v2a_gate",
    "scale_shift_table_a2v_ca_video": "video_a2v_cross_attn_scale_shift_table",
    "scale_shift_table_a2v_ca_audio": "audio_a2v_cross_attn_scale_shift_table",
    "q_norm": "norm_q",
    "k_norm": "norm_k",
}
_DIT_SEGMENTS_BACK = _invert(DIT_SEGMENTS)
# what diffusers 0.42's converter leaves in the official names (LTX-2.3's prompt AdaLN)
_DIT_AFTER_DIFFUSERS = {"prompt_adaln_single": "prompt_adaln", "audio_prompt_adaln_single": "audio_prompt_adaln"}


_OTHER_PARTS = (TEXT_PROJECTION_PREFIX, VIDEO_VAE_PREFIX, AUDIO_VAE_PREFIX, VOCODER_PREFIX)


def dit_to_diffusers(state: Mapping[str, object]) -> dict:
    """The DiT's official keys (with or without `model.diffusion_model.`) -> `LTX2VideoTransformer3DModel`'s. The
    text connectors' keys and the other parts' (`text_embedding_projection.`, `vae.`, `audio_vae.`, `vocoder.`: no
    DiT module is named so), if there, are left out: a whole single file may be given."""
    from diffusers.loaders.single_file_utils import convert_ltx2_transformer_to_diffusers

    mine = {k.removeprefix(DIT_PREFIX): v for k, v in state.items()
            if not _is_connector(k) and not k.startswith(_OTHER_PARTS)}
    out = convert_ltx2_transformer_to_diffusers(dict(mine))
    return {_segments(k, _DIT_AFTER_DIFFUSERS): v for k, v in out.items()}


def dit_to_original(state: Mapping[str, object], prefix: str = DIT_PREFIX) -> dict:
    """`LTX2VideoTransformer3DModel`'s keys -> the official ones, under `prefix` (the single file's and the Repackage
    `transformer.safetensors`'; "" for none)."""
    return {prefix + _segments(k, _DIT_SEGMENTS_BACK): v for k, v in state.items()}


# -- the video VAE -----------------------------------------------------------------------------------------------

_STATISTICS = {"mean-of-means": "latents_mean", "std-of-means": "latents_std"}
_STATISTICS_BACK = _invert(_STATISTICS)
_DECODER_TOP = {"last_time_embedder": "time_embedder", "last_scale_shift_table": "scale_shift_table"}
_DECODER_TOP_BACK = _invert(_DECODER_TOP)
_BLOCK = re.compile(r"^(encoder|decoder)\.(down_blocks|up_blocks|mid_block)(?:\.(\d+))?(?:\.(downsamplers|upsamplers)\.0)?\.(.*)$")
_RESNETS = {"res_blocks": "resnets"}
_RESNETS_BACK = _invert(_RESNETS)


def _video_vae_after_diffusers(key: str) -> str:
    """What diffusers 0.42's video VAE converter leaves: the decoder's blocks past its table (LTX-2.3 has 9: its up
    blocks 7 and 8 are diffusers' fourth upsampler and up block) and the decoder's own timestep embedding."""
    m = re.match(r"^decoder\.up_blocks\.(\d+)\.(.*)$", key)
    if m and int(m.group(1)) >= 7:
        i = int(m.group(1))
        rest = _segments(m.group(2), _RESNETS)
        return f"decoder.up_blocks.{(i - 1) // 2}.upsamplers.0.{rest}" if i % 2 else f"decoder.up_blocks.{i // 2 - 1}.{rest}"
    head, _, rest = key.partition(".")
    if head == "decoder" and rest.split(".")[0] in _DECODER_TOP:
        first, _, tail = rest.partition(".")
        return f"decoder.{_DECODER_TOP[first]}" + (f".{tail}" if tail else "")
    return key


def video_vae_to_diffusers(state: Mapping[str, object]) -> dict:
    """The video VAE's official keys (`vae.encoder.*`, `vae.decoder.*`, `vae.per_channel_statistics.*`; the prefix
    may be left off) -> `AutoencoderKLLTX2Video`'s. An encoder-only or decoder-only file (the Repackage
    `video_vae_encoder` / `video_vae_decoder`) gives that half and `latents_mean` / `latents_std`."""
    from diffusers.loaders.single_file_utils import convert_ltx2_vae_to_diffusers

    mine = {}
    for k, v in state.items():
        k = k.removeprefix(VIDEO_VAE_PREFIX)
        if VIDEO_VAE_PREFIX + k not in DROPPED_ORIGINAL_KEYS:
            mine[k] = v
    out = convert_ltx2_vae_to_diffusers(dict(mine))
    return {_video_vae_after_diffusers(k): v for k, v in out.items()}


def _video_block_back(key: str, down_blocks: int) -> str:
    m = _BLOCK.match(key)
    if not m:
        return key
    half, kind, index, sampler, rest = m.groups()
    rest = _segments(rest, _RESNETS_BACK)
    if half == "encoder" and kind == "mid_block":
        return f"encoder.down_blocks.{2 * down_blocks}.{rest}"
    if half == "encoder" and kind == "down_blocks":
        return f"encoder.down_blocks.{2 * int(index) + (1 if sampler else 0)}.{rest}"
    if half == "decoder" and kind == "mid_block":
        return f"decoder.up_blocks.0.{rest}"
    if half == "decoder" and kind == "up_blocks":
        return f"decoder.up_blocks.{2 * int(index) + (1 if sampler else 2)}.{rest}"
    return key


def video_vae_to_original(state: Mapping[str, object], prefix: str = VIDEO_VAE_PREFIX) -> dict:
    """`AutoencoderKLLTX2Video`'s keys (or one half's and the two statistics) -> the official ones, under `prefix`.
    The statistics diffusers drops (`DROPPED_ORIGINAL_KEYS`) cannot come back."""
    down = {int(m.group(1)) for k in state if (m := re.match(r"^encoder\.down_blocks\.(\d+)\.", k))}
    n_down = max(down) + 1 if down else 0
    out = {}
    for k, v in state.items():
        if k in _STATISTICS_BACK:
            new = f"per_channel_statistics.{_STATISTICS_BACK[k]}"
        elif k.startswith("decoder.") and k.split(".")[1] in _DECODER_TOP_BACK:
            first, _, tail = k[len("decoder."):].partition(".")
            new = f"decoder.{_DECODER_TOP_BACK[first]}" + (f".{tail}" if tail else "")
        else:
            new = _video_block_back(k, n_down)
        out[prefix + new] = v
    return out


# -- the audio VAE -----------------------------------------------------------------------------------------------

def audio_vae_to_diffusers(state: Mapping[str, object]) -> dict:
    """The audio VAE's official keys (`audio_vae.encoder.*`, `audio_vae.decoder.*`,
    `audio_vae.per_channel_statistics.*`; the prefix may be left off) -> `AutoencoderKLLTX2Audio`'s. The encoder and
    decoder keep their module names; the statistics become `latents_mean` / `latents_std`."""
    from diffusers.loaders.single_file_utils import convert_ltx2_audio_vae_to_diffusers

    return convert_ltx2_audio_vae_to_diffusers({k.removeprefix(AUDIO_VAE_PREFIX): v for k, v in state.items()})


def audio_vae_to_original(state: Mapping[str, object], prefix: str = AUDIO_VAE_PREFIX) -> dict:
    """`AutoencoderKLLTX2Audio`'s keys -> the official ones, under `prefix`."""
    return {prefix + (f"per_channel_statistics.{_STATISTICS_BACK[k]}" if k in _STATISTICS_BACK else k): v
            for k, v in state.items()}


# -- the text connectors (Gemma feature projection + the video and audio connectors) -----------------------------

CONNECTOR_MODULE_NAMES = {
    "video_embeddings_connector": "video_connector",
    "audio_embeddings_connector": "audio_connector",
}
# text_embedding_projection.<name> -> LTX2TextConnectors.<name>: 2.0 has one projection, 2.3 one per modality
PROJECTION_NAMES = {
    "aggregate_embed": "text_proj_in",
    "video_aggregate_embed": "video_text_proj_in",
    "audio_aggregate_embed": "audio_text_proj_in",
}
CONNECTOR_SEGMENTS = {"transformer_1d_blocks": "transformer_blocks", "q_norm": "norm_q", "k_norm": "norm_k"}
_CONNECTOR_MODULE_NAMES_BACK = _invert(CONNECTOR_MODULE_NAMES)
_PROJECTION_NAMES_BACK = _invert(PROJECTION_NAMES)
_CONNECTOR_SEGMENTS_BACK = _invert(CONNECTOR_SEGMENTS)


def connectors_to_diffusers(state: Mapping[str, object]) -> dict:
    """The connectors' official keys (`text_embedding_projection.*`,
    `model.diffusion_model.{video,audio}_embeddings_connector.*`, the DiT prefix may be left off; the Repackage
    `text_encoder_post_modules`) -> `LTX2TextConnectors`' (2.0 and 2.3 alike)."""
    out = {}
    for k, v in state.items():
        if k.startswith(TEXT_PROJECTION_PREFIX):
            first, _, rest = k[len(TEXT_PROJECTION_PREFIX):].partition(".")
            new = f"{PROJECTION_NAMES.get(first, first)}.{rest}"
        else:
            first, _, rest = k.removeprefix(DIT_PREFIX).partition(".")
            new = f"{CONNECTOR_MODULE_NAMES.get(first, first)}.{_segments(rest, CONNECTOR_SEGMENTS)}"
        out[new] = v
    return out


def connectors_to_original(state: Mapping[str, object], prefix: str = DIT_PREFIX) -> dict:
    """`LTX2TextConnectors`' keys -> the official ones: the projections under `text_embedding_projection.`, the two
    connectors under `prefix` (the DiT's)."""
    out = {}
    for k, v in state.items():
        first, _, rest = k.partition(".")
        if first in _PROJECTION_NAMES_BACK:
            out[f"{TEXT_PROJECTION_PREFIX}{_PROJECTION_NAMES_BACK[first]}.{rest}"] = v
        else:
            name = _CONNECTOR_MODULE_NAMES_BACK.get(first, first)
            out[f"{prefix}{name}.{_segments(rest, _CONNECTOR_SEGMENTS_BACK)}"] = v
    return out


# -- the vocoder -------------------------------------------------------------------------------------------------

# official -> diffusers, whole segments; LTX-2.3's vocoder (with bandwidth extension) nests two of them (`vocoder.*`,
# `bwe_generator.*`) beside its `mel_stft.*` buffers, each with anti-aliased activations (`downsample.lowpass.filter`
# in the original, `downsample.filter` in diffusers)
VOCODER_SEGMENTS = {"conv_pre": "conv_in", "ups": "upsamplers", "resblocks": "resnets", "conv_post": "conv_out",
                    "act_post": "act_out"}
_VOCODER_SEGMENTS_BACK = _invert(VOCODER_SEGMENTS)


def vocoder_to_diffusers(state: Mapping[str, object]) -> dict:
    """The vocoder's official keys, as the file has them (`vocoder.*`; LTX-2.3's `vocoder.vocoder.*`,
    `vocoder.bwe_generator.*`, `vocoder.mel_stft.*`) -> `LTX2Vocoder`'s / `LTX2VocoderWithBWE`'s."""
    out = {}
    for k, v in state.items():
        k = _segments(k.removeprefix(VOCODER_PREFIX), VOCODER_SEGMENTS)
        out[k.replace(".downsample.lowpass.", ".downsample.")] = v
    return out


def vocoder_to_original(state: Mapping[str, object], prefix: str = VOCODER_PREFIX) -> dict:
    """`LTX2Vocoder`'s / `LTX2VocoderWithBWE`'s keys -> the official ones, under `prefix`."""
    out = {}
    for k, v in state.items():
        k = _segments(k, _VOCODER_SEGMENTS_BACK)
        if k.endswith(".downsample.filter"):
            k = k[: -len("filter")] + "lowpass.filter"
        out[prefix + k] = v
    return out


# -- every part at once --------------------------------------------------------------------------------------------

PARTS = ("dit", "connectors", "video_vae", "audio_vae", "vocoder")
TO_DIFFUSERS = {"dit": dit_to_diffusers, "connectors": connectors_to_diffusers, "video_vae": video_vae_to_diffusers,
                "audio_vae": audio_vae_to_diffusers, "vocoder": vocoder_to_diffusers}
TO_ORIGINAL = {"dit": dit_to_original, "connectors": connectors_to_original, "video_vae": video_vae_to_original,
               "audio_vae": audio_vae_to_original, "vocoder": vocoder_to_original}


def single_file_to_diffusers(state: Mapping[str, object]) -> dict[str, dict]:
    """An official single file (or the seven Repackage files' tensors together) -> each part's diffusers state dict
    (`PARTS`). Keys of no part are left out (`unassigned_keys` names them)."""
    by_part = {"dit": {}, "connectors": {}, "video_vae": {}, "audio_vae": {}, "vocoder": {}}
    for k, v in state.items():
        if k.startswith(DIT_PREFIX):
            by_part["connectors" if _is_connector(k) else "dit"][k] = v
        elif k.startswith(TEXT_PROJECTION_PREFIX):
            by_part["connectors"][k] = v
        elif k.startswith(VIDEO_VAE_PREFIX):
            by_part["video_vae"][k] = v
        elif k.startswith(AUDIO_VAE_PREFIX):
            by_part["audio_vae"][k] = v
        elif k.startswith(VOCODER_PREFIX):
            by_part["vocoder"][k] = v
    return {part: TO_DIFFUSERS[part](sd) for part, sd in by_part.items()}


def diffusers_to_single_file(parts: Mapping[str, Mapping[str, object]]) -> dict:
    """Each part's diffusers state dict (`PARTS`, any subset) -> one state dict in the official single file's names
    (without the statistics diffusers drops)."""
    out = {}
    for part, sd in parts.items():
        out.update(TO_ORIGINAL[part](sd))
    return out


__all__ = [
    "AUDIO_VAE_PREFIX", "CONNECTOR_MODULES", "DIT_PREFIX", "DROPPED_ORIGINAL_KEYS", "DROPPED_VIDEO_VAE_STATISTICS",
    "JOYAI_ECHO_FILE", "OFFICIAL_FILES", "PARTS", "REPACKAGE_FILES", "TEXT_PROJECTION_PREFIX", "TO_DIFFUSERS",
    "TO_ORIGINAL", "VIDEO_VAE_PREFIX", "VOCODER_PREFIX", "audio_vae_to_diffusers", "audio_vae_to_original",
    "connectors_to_diffusers", "connectors_to_original", "diffusers_to_single_file", "dit_to_diffusers",
    "dit_to_original", "single_file_to_diffusers", "split_single_file", "unassigned_keys", "video_vae_to_diffusers",
    "video_vae_to_original", "vocoder_to_diffusers", "vocoder_to_original",
]
