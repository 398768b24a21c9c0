"""LTX-2 / LTX-2.3 names (difftune.families.ltx2.names) on tiny random models and on the released sizes' shapes.

* Each part both ways, both versions: diffusers' state dict -> official names -> back gives every key and tensor,
  and the official file's keys -> diffusers -> back gives the file's keys less the statistics diffusers drops.
* The released models' names and shapes (built on the meta device at the real sizes, through `*_to_original`) hash to
  the keys-and-shapes MD5 DiffSynth-Studio recognises each released file by (diffsynth/configs/model_configs.py,
  `ltx2_series`): the official single files and all seven Repackage files of both versions.
* The tiny Repackage files, the official single files and JoyAI-Echo's file load back into the diffusers classes
  with every key used and none missing; diffusers' own single-file converters read the written DiT and VAEs.
* The Gemma-3 folder loads with transformers and its tokenizer encodes; the tiny models chain (Gemma -> connectors ->
  DiT, the VAEs and the vocoder) with outputs that are not zero.
"""

from __future__ import annotations

import hashlib
import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

from difftune.families.ltx2 import names as N
from support.ltx2 import tiny as T

VERSIONS = ("2", "2.3")


def _state(model) -> dict:
    return {k: v.detach() for k, v in model.state_dict().items()}


def _assert_same(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    bad = [k for k in want if got[k].shape != want[k].shape or not torch.equal(got[k], want[k])]
    assert not bad, bad[:5]


@pytest.fixture(scope="module")
def models():
    return {v: T.tiny_ltx2_models(v) for v in VERSIONS}


@pytest.fixture(scope="module")
def officials(models):
    return {v: T.official_state(models[v], v) for v in VERSIONS}


@pytest.fixture(scope="module")
def written(tmp_path_factory, models):
    root = tmp_path_factory.mktemp("ltx2")
    out = {}
    for v in VERSIONS:
        out[v, "repackage"] = T.write_tiny_ltx2_repackage(root / f"repackage-{v}", v)
        out[v, "official"] = T.write_tiny_ltx2_official(root / f"official-{v}", v)
    out["joyai"] = T.write_tiny_joyai_echo(root / "joyai")
    out["gemma"] = T.write_tiny_gemma3(root / "gemma-3-12b-it-qat-q4_0-unquantized")
    return out


# -- renames -------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("part", N.PARTS)
def test_round_trip_each_part(models, officials, version, part):
    sd = _state(models[version][part])
    original = N.TO_ORIGINAL[part](sd)
    back = N.TO_DIFFUSERS[part](original)
    _assert_same(back, sd)
    assert all(back[k] is sd[k] for k in sd)  # renamed, never copied
    # the official file's keys of this part -> diffusers -> back: all of them but the statistics diffusers drops
    mine = {k: v for k, v in officials[version].items() if _owner(k) is N.TO_DIFFUSERS[part]}
    kept = {k: v for k, v in mine.items() if k not in N.DROPPED_ORIGINAL_KEYS}
    assert sorted(kept) == sorted(original)
    _assert_same(N.TO_ORIGINAL[part](N.TO_DIFFUSERS[part](mine)), kept)


def _owner(key: str):
    """The part's to_diffusers that takes an official key (the split the single file's prefixes make)."""
    if key.startswith(N.DIT_PREFIX):
        return N.connectors_to_diffusers if key.removeprefix(N.DIT_PREFIX).startswith(N.CONNECTOR_MODULES) \
            else N.dit_to_diffusers
    for prefix, fn in ((N.TEXT_PROJECTION_PREFIX, N.connectors_to_diffusers), (N.VIDEO_VAE_PREFIX, N.video_vae_to_diffusers),
                       (N.AUDIO_VAE_PREFIX, N.audio_vae_to_diffusers), (N.VOCODER_PREFIX, N.vocoder_to_diffusers)):
        if key.startswith(prefix):
            return fn
    return None


def test_dit_keys_with_or_without_the_prefix_and_connectors_left_out(models):
    sd = _state(models["2.3"]["dit"])
    original = N.dit_to_original(sd)
    bare = N.dit_to_original(sd, prefix="")
    assert all(k.startswith(N.DIT_PREFIX) for k in original) and not any(k.startswith("model.") for k in bare)
    whole = T.official_state(models["2.3"], "2.3")  # the connectors and every other part's keys are left out
    for given in (original, bare, whole):
        _assert_same(N.dit_to_diffusers(given), sd)
    # 2.3's own names, and 2.0's where the two differ
    assert "model.diffusion_model.prompt_adaln_single.linear.weight" in original
    assert "model.diffusion_model.transformer_blocks.0.attn1.to_gate_logits.weight" in original
    assert "model.diffusion_model.caption_projection.linear_1.weight" in N.dit_to_original(_state(models["2"]["dit"]))


def test_dropped_statistics_only_in_ltx2_0(models, officials):
    o2, o23 = officials["2"], officials["2.3"]
    assert N.DROPPED_ORIGINAL_KEYS <= set(o2) and not N.DROPPED_ORIGINAL_KEYS & set(o23)
    converted = N.video_vae_to_diffusers({k: v for k, v in o2.items() if k.startswith("vae.")})
    _assert_same(converted, _state(models["2"]["video_vae"]))
    assert not N.unassigned_keys(o2) and not N.unassigned_keys(o23)


def test_vocoder_ups_never_touches_upsample():
    key = "resnets.0.acts1.0.upsample.filter"
    assert N.vocoder_to_original({key: 0}) == {"vocoder.resblocks.0.acts1.0.upsample.filter": 0}
    assert N.vocoder_to_original({"vocoder.resnets.1.acts2.2.downsample.filter": 0}) == {
        "vocoder.vocoder.resblocks.1.acts2.2.downsample.lowpass.filter": 0}
    assert N.vocoder_to_diffusers({"vocoder.vocoder.ups.3.weight": 0, "vocoder.bwe_generator.act_post.act.beta": 1}) == {
        "vocoder.upsamplers.3.weight": 0, "bwe_generator.act_out.act.beta": 1}


# -- the released sizes ----------------------------------------------------------------------------------------------

# DiffSynth-Studio's model_hash of each released file: md5 of the sorted "key:d0_d1_..." and "key" strings
RELEASED = {
    "2": {"ltx-2-19b-dev.safetensors": "aca7b0bbf8415e9c98360750268915fc",
          "transformer.safetensors": "c567aaa37d5ed7454c73aa6024458661",
          "text_encoder_post_modules.safetensors": "981629689c8be92a712ab3c5eb4fc3f6",
          "video_vae_encoder.safetensors": "7f7e904a53260ec0351b05f32153754b",
          "video_vae_decoder.safetensors": "dc6029ca2825147872b45e35a2dc3a97",
          "audio_vae_encoder.safetensors": "29338f3b95e7e312a3460a482e4f4554",
          "audio_vae_decoder.safetensors": "7d7823dde8f1ea0b50fb07ac329dd4cb",
          "audio_vocoder.safetensors": "f471360f6b24bef702ab73133d9f8bb9"},
    "2.3": {"ltx-2.3-22b-dev.safetensors": "f3a83ecf3995dcc4fae2d27e08ad5767",
            "transformer.safetensors": "1c55afad76ed33c112a2978550b524d1",
            "text_encoder_post_modules.safetensors": "05da2aab1c4b061f72c426311c165a43",
            "video_vae_encoder.safetensors": "eecdc07c2ec30863b8a2b8b2134036cf",
            "video_vae_decoder.safetensors": "deda2f542e17ee25bc8c38fd605316ea",
            "audio_vae_encoder.safetensors": "29338f3b95e7e312a3460a482e4f4554",  # LTX-2's audio VAE
            "audio_vae_decoder.safetensors": "7d7823dde8f1ea0b50fb07ac329dd4cb",
            "audio_vocoder.safetensors": "cd436c99e69ec5c80f050f0944f02a15"},
}


def _keys_hash(state: dict) -> str:
    names = []
    for k, v in state.items():
        names += [k + ":" + "_".join(str(d) for d in v.shape), k]
    return hashlib.md5(",".join(sorted(names)).encode()).hexdigest()


@pytest.mark.parametrize("version", VERSIONS)
def test_released_names_and_shapes(version):
    classes, configs = T.ltx2_classes(version), T.real_configs(version)
    with torch.device("meta"):
        parts = {p: classes[p](**configs[p]).state_dict() for p in N.PARTS}
        single = N.diffusers_to_single_file(parts)
        single.update({k: torch.empty(128) for k in N.DROPPED_ORIGINAL_KEYS if version == "2"})
    got = {name: _keys_hash(sd) for name, sd in N.split_single_file(single).items()}
    got[N.OFFICIAL_FILES[version]] = _keys_hash(single)
    assert got == RELEASED[version]
    # ... and back: every released key of every part has its place in the diffusers model, shapes included
    for part, sd in N.single_file_to_diffusers(single).items():
        assert {k: v.shape for k, v in sd.items()} == {k: v.shape for k, v in parts[part].items()}, part


# -- the written files -----------------------------------------------------------------------------------------------

# Repackage file -> (part, which of the part's diffusers keys it holds)
_HOLDS = {
    "transformer.safetensors": ("dit", lambda k: True),
    "text_encoder_post_modules.safetensors": ("connectors", lambda k: True),
    "video_vae_encoder.safetensors": ("video_vae", lambda k: k.startswith(("encoder.", "latents_"))),
    "video_vae_decoder.safetensors": ("video_vae", lambda k: k.startswith(("decoder.", "latents_"))),
    "audio_vae_encoder.safetensors": ("audio_vae", lambda k: k.startswith(("encoder.", "latents_"))),
    "audio_vae_decoder.safetensors": ("audio_vae", lambda k: k.startswith(("decoder.", "latents_"))),
    "audio_vocoder.safetensors": ("vocoder", lambda k: True),
}


@pytest.mark.parametrize("version", VERSIONS)
def test_repackage_files_load_back(written, models, version):
    files = written[version, "repackage"]
    assert sorted(p.name for p in files.values()) == sorted(N.REPACKAGE_FILES)
    halves = {}
    for name, path in files.items():
        part, holds = _HOLDS[name]
        sd = N.TO_DIFFUSERS[part](load_file(str(path)))
        want = {k: v for k, v in _state(models[version][part]).items() if holds(k)}
        _assert_same(sd, want)
        halves.setdefault(part, {}).update(sd)
    for part, sd in halves.items():  # the two halves of each VAE together: a whole model, strictly
        fresh = T.ltx2_classes(version)[part](**T.tiny_configs(version)[part])
        fresh.load_state_dict(sd, strict=True)
        _assert_same(_state(fresh), _state(models[version][part]))


@pytest.mark.parametrize("version", VERSIONS)
def test_official_file_loads_back(written, models, version):
    path = written[version, "official"]
    assert path.name == N.OFFICIAL_FILES[version]
    state = load_file(str(path))
    assert not N.unassigned_keys(state)
    assert set(state) - set(N.diffusers_to_single_file({p: _state(models[version][p]) for p in N.PARTS})) == (
        set(N.DROPPED_ORIGINAL_KEYS) if version == "2" else set())
    for part, sd in N.single_file_to_diffusers(state).items():
        _assert_same(sd, _state(models[version][part]))
    repackage = written[version, "repackage"]
    for name, part_state in N.split_single_file(state).items():
        _assert_same(part_state, load_file(str(repackage[name])))


def test_joyai_echo_splits_into_ltx2_3_parts(written, models):
    path = written["joyai"]
    assert path.name == N.JOYAI_ECHO_FILE
    state = load_file(str(path))
    assert not N.unassigned_keys(state)
    repackage = written["2.3", "repackage"]
    for name, part_state in N.split_single_file(state).items():
        with safe_open(str(repackage[name]), "pt") as f:
            assert {k: list(v.shape) for k, v in part_state.items()} == {k: f.get_slice(k).get_shape() for k in f.keys()}
    parts = N.single_file_to_diffusers(state)
    joyai = T.tiny_joyai_echo_models()
    for part, sd in parts.items():
        fresh = T.ltx2_classes("2.3")[part](**T.tiny_configs("2.3")[part])
        fresh.load_state_dict(sd, strict=True)
        _assert_same(sd, _state(joyai[part]))
    base = _state(models["2.3"]["dit"])  # the fine-tune's DiT differs from LTX-2.3's; the other parts are LTX-2.3's
    assert not torch.equal(parts["dit"]["proj_in.weight"], base["proj_in.weight"])
    _assert_same(parts["video_vae"], _state(models["2.3"]["video_vae"]))


@pytest.mark.parametrize("version", VERSIONS)
def test_diffusers_single_file_converters_read_the_files(written, models, version):
    from diffusers.loaders.single_file_utils import (convert_ltx2_audio_vae_to_diffusers,
                                                     convert_ltx2_transformer_to_diffusers,
                                                     convert_ltx2_vae_to_diffusers)

    state = load_file(str(written[version, "official"]))
    pick = lambda prefixes: {k: v for k, v in state.items() if k.startswith(prefixes)}  # noqa: E731
    dit = convert_ltx2_transformer_to_diffusers(pick((N.DIT_PREFIX,)))
    vae = convert_ltx2_vae_to_diffusers(pick((N.VIDEO_VAE_PREFIX,)))
    audio = convert_ltx2_audio_vae_to_diffusers(pick((N.AUDIO_VAE_PREFIX,)))
    _assert_same(audio, _state(models[version]["audio_vae"]))
    want_dit, want_vae = _state(models[version]["dit"]), _state(models[version]["video_vae"])
    if version == "2":
        _assert_same(dit, want_dit)
        _assert_same(vae, want_vae)
    else:  # diffusers 0.42's converters stop short of LTX-2.3 exactly where names.py renames after them
        assert sorted(set(dit) - set(want_dit)) == sorted(k.replace("prompt_adaln.", "prompt_adaln_single.")
                                                          for k in want_dit if "prompt_adaln." in k)
        assert {k for k in set(vae) - set(want_vae)} == {k for k in vae if k.startswith(("decoder.up_blocks.7.",
                                                                                         "decoder.up_blocks.8."))}


# -- Gemma-3 and the chain -----------------------------------------------------------------------------------------

def test_gemma3_folder_loads(written):
    from transformers import AutoTokenizer, Gemma3ForConditionalGeneration

    folder = written["gemma"]
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    assert sorted(set(index["weight_map"].values())) == list(T.GEMMA3_SHARDS)
    keys = set(index["weight_map"])
    for shard in T.GEMMA3_SHARDS:
        with safe_open(str(folder / shard), "pt") as f:
            assert {k for k, s in index["weight_map"].items() if s == shard} == set(f.keys())
    assert "language_model.model.embed_tokens.weight" in keys and "multi_modal_projector.mm_input_projection_weight" in keys
    assert any(k.startswith("vision_tower.vision_model.encoder.layers.0.") for k in keys)
    assert not any(k.startswith(("model.", "lm_head.")) for k in keys)
    config = json.loads((folder / "config.json").read_text())
    assert set(config) >= {"text_config", "vision_config"} and config["architectures"] == ["Gemma3ForConditionalGeneration"]

    model = Gemma3ForConditionalGeneration.from_pretrained(str(folder))
    _assert_same(_state(model), _state(T.tiny_gemma3()))
    tok = AutoTokenizer.from_pretrained(str(folder))
    ids = tok("a cat").input_ids
    assert len(ids) > 1 and ids[0] == tok.bos_token_id == 2 and tok.pad_token_id == 0 and tok.eos_token_id == 1
    assert tok.decode(ids, skip_special_tokens=True) == "a cat"
    assert {"<start_of_turn>", "<end_of_turn>"} <= set(tok.get_vocab())
    assert tok("a cat") == T.gemma3_tokenizer()("a cat")
    assert (folder / "special_tokens_map.json").is_file() and (folder / "tokenizer_config.json").is_file()


@pytest.mark.parametrize("version", VERSIONS)
def test_tiny_models_chain(models, version):
    m, tok = models[version], T.gemma3_tokenizer()
    registers = m["connectors"].config.video_connector_num_learnable_registers
    with torch.no_grad():
        enc = tok(["a cat"], padding="max_length", max_length=registers, return_tensors="pt")
        out = m["text_encoder"].model.language_model(input_ids=enc.input_ids, attention_mask=enc.attention_mask,
                                                     output_hidden_states=True)
        hidden = torch.stack(out.hidden_states, dim=-1)
        assert hidden.shape[-2:] == (T.GEMMA_HIDDEN, m["connectors"].config.text_proj_in_factor)
        video_text, audio_text, mask = m["connectors"](hidden, enc.attention_mask)
        f, h, w, a = 2, 2, 3, 5
        extra = {"sigma": torch.tensor([0.5]), "use_cross_timestep": True} if version == "2.3" else {}
        video, audio = m["dit"](hidden_states=torch.randn(1, f * h * w, T.VIDEO_LATENT_CHANNELS),
                                audio_hidden_states=torch.randn(1, a, T.AUDIO_IN_CHANNELS),
                                encoder_hidden_states=video_text, audio_encoder_hidden_states=audio_text,
                                timestep=torch.tensor([500.0]), encoder_attention_mask=mask,
                                audio_encoder_attention_mask=mask, num_frames=f, height=h, width=w,
                                audio_num_frames=a, return_dict=False, **extra)
        assert video.shape == (1, f * h * w, T.VIDEO_LATENT_CHANNELS) and audio.shape == (1, a, T.AUDIO_IN_CHANNELS)
        latent = m["video_vae"].encode(torch.rand(1, 3, 9, 64, 64) * 2 - 1).latent_dist.mode()
        assert latent.shape == (1, T.VIDEO_LATENT_CHANNELS, 2, 2, 2)  # 8x in time (causal: 1 + 8), 32x in space
        frames = m["video_vae"].decode(latent).sample
        mel = m["audio_vae"].encode(torch.randn(1, 2, 20, T.MEL_BINS)).latent_dist.mode()
        assert mel.shape == (1, T.AUDIO_LATENT_CHANNELS, 5, T.LATENT_MEL_BINS)  # 4x in time and mel
        spectrogram = m["audio_vae"].decode(mel).sample
        wave = m["vocoder"](spectrogram)
        rate = m["vocoder"].config.output_sampling_rate
        assert wave.shape == (1, 2, spectrogram.shape[2] * 160 * rate // 16000)  # hop 160 at 16 kHz
    for x in (video_text, audio_text, video, audio, frames, spectrogram, wave):
        assert torch.isfinite(x).all() and x.abs().mean() > 1e-3


def test_seeded(models):
    again = T.tiny_ltx2_models("2")
    for part in N.PARTS:
        _assert_same(_state(again[part]), _state(models["2"][part]))
    other = _state(T.tiny_ltx2_dit("2", seed=1))
    assert not torch.equal(other["proj_in.weight"], _state(models["2"]["dit"])["proj_in.weight"])
