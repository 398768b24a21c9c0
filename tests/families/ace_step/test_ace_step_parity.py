"""ACE-Step sampling against diffusers' `AceStepPipeline` on the same tiny models (float32, CPU): the same noise, the
same prompt, lyrics and metadata, 2 steps at shift 3.

Measured here: the waveforms and latents agree exactly (max |diff| 0.0) at guidance 1; at guidance 4 difftune and
the reference combine plain CFG with the null condition (`nega + s * (posi - nega)`), diffusers its APG (momentum
-0.75, norm threshold 2.5): 0.037 apart on the waveform, 6.6e-7 once diffusers' guidance is replaced by the plain
formula. A duration that is no whole number of frames: difftune and the reference round the frames (2.5 s -> 62),
diffusers takes the ceiling (63)."""

from __future__ import annotations

import pytest
import torch

from difftune.families.ace_step import AceStepPipeline
from difftune.families.ace_step.pipeline import CALL_PARAMETERS
from difftune.families.ace_step.units import LYRIC_PROMPT, SFT_GEN_PROMPT, TEXT2MUSIC, metas

C = 8  # latent channels of the tiny models (64 in the release)
PROMPT, LYRICS = "a calm piano piece", "[verse]\nla la"
META = {"bpm": 120, "keyscale": "C major", "timesignature": "3"}
WAVE_BOUND = LATENT_BOUND = 1e-6  # both measured 0.0


def _models():
    from diffusers import AceStepTransformer1DModel, AutoencoderOobleck
    from diffusers.pipelines.ace_step.modeling_ace_step import AceStepConditionEncoder
    from transformers import Qwen3Config, Qwen3Model

    from support.z_image.tiny import z_image_tokenizer

    torch.manual_seed(0)
    tok = z_image_tokenizer()
    models = {
        "dit": AceStepTransformer1DModel(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                                         in_channels=3 * C, audio_acoustic_hidden_dim=C, patch_size=2,
                                         sliding_window=4, encoder_hidden_size=24),
        "conditioner": AceStepConditionEncoder(hidden_size=24, intermediate_size=48, text_hidden_dim=16,
                                               timbre_hidden_dim=C, num_lyric_encoder_hidden_layers=1,
                                               num_timbre_encoder_hidden_layers=1, num_attention_heads=2,
                                               num_key_value_heads=1, head_dim=12, sliding_window=4),
        "text_encoder": Qwen3Model(Qwen3Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32,
                                               num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                                               head_dim=8)),
        "vae": AutoencoderOobleck(encoder_hidden_size=2 * C, downsampling_ratios=[2, 4, 4, 6, 10],
                                  channel_multiples=[1, 1, 1, 1, 1], decoder_channels=8, decoder_input_channels=C,
                                  audio_channels=2, sampling_rate=48000),
    }
    for m in models.values():
        m.eval()
    return models, tok


@pytest.fixture(scope="module")
def pipes():
    from diffusers import AceStepPipeline as DiffusersAceStep
    from diffusers import FlowMatchEulerDiscreteScheduler

    models, tok = _models()
    ours = AceStepPipeline()
    for slot, m in models.items():
        setattr(ours, slot, m)
    ours.tokenizer, ours.silence_latent = tok, torch.randn(1, 800, C)
    # diffusers reads the silence from the condition encoder's buffer, difftune (as the reference) from the pipe
    models["conditioner"].silence_latent = ours.silence_latent.clone()
    # as diffusers' converter writes it: the DiT takes t in [0, 1], the pipeline gives the shifted sigmas itself
    theirs = DiffusersAceStep(vae=models["vae"], text_encoder=models["text_encoder"], tokenizer=tok,
                              transformer=models["dit"], condition_encoder=models["conditioner"],
                              scheduler=FlowMatchEulerDiscreteScheduler(num_train_timesteps=1, shift=1.0))
    theirs.set_progress_bar_config(disable=True)
    assert not theirs.is_turbo  # so guidance > 1 runs there too
    return ours, theirs


def _ours(pipe, latents=None, prompt=PROMPT, output_type="pil", cfg_scale=1.0, steps=2, **kw):
    call = {"lyrics": LYRICS, "duration": 2, "vocal_language": "en", **META, **kw}
    if latents is None:
        out = pipe(prompt, cfg_scale=cfg_scale, num_inference_steps=steps, progress=False, output_type=output_type,
                   **call)
        return torch.as_tensor(out)
    # the initial latents given: the noise unit is skipped, as validation's cached inputs are
    values = {**pipe.prompt_values(prompt, ""), **CALL_PARAMETERS, **call, "seed": None, "rand_device": "cpu",
              "input_image": None, "latents": latents}
    out = pipe.generate(values, cfg_scale=cfg_scale, num_inference_steps=steps, given={"latents"}, progress=False,
                        output_type=output_type)
    return torch.as_tensor(out[0] if output_type == "pil" else out)


def _theirs(pipe, latents, prompt=PROMPT, output_type="pt", guidance_scale=1.0, steps=2, **kw):
    call = {"lyrics": LYRICS, "audio_duration": 2, "vocal_language": "en", **META, **kw}
    out = pipe(prompt=prompt, latents=latents, num_inference_steps=steps, guidance_scale=guidance_scale, shift=3.0,
               output_type=output_type, **call).audios
    return out[0]


def _noise(seed, frames=50):
    return torch.randn((1, frames, C), generator=torch.Generator("cpu").manual_seed(seed))


def test_turbo_sampling_equals_diffusers(pipes):
    """Guidance 1 (the turbo DiTs): ours seeded, diffusers given the same draw (the draws agree: one CPU
    generator, float32, (1, frames, 64)); then both given other latents. Max |diff| 0.0 on waveform and latents."""
    ours, theirs = pipes
    wave = _ours(ours, seed=1)
    want = _theirs(theirs, _noise(1))
    assert wave.shape == want.shape == (2, 96000)
    assert (wave - want).abs().max() <= WAVE_BOUND
    assert abs(float(wave.abs().max()) - 10 ** (-1 / 20)) < 1e-6  # both normalise to a -1 dBFS peak
    other = _noise(7)
    got = _ours(ours, latents=other, output_type="latent")
    assert (got[0] - _theirs(theirs, other, output_type="latent")).abs().max() <= LATENT_BOUND
    # the given latents were used, not the seeded ones
    assert (got - _ours(ours, seed=7, output_type="latent")).abs().max() == 0


def test_every_input_moves_the_output_far_past_the_bound(pipes):
    """The comparison above is not blind: each caption, lyric and metadata input moves difftune's latents by 1e-3
    or more on these models (bpm 5e-3, language 1e-3, prompt 2e-2), over 100x the bound."""
    ours, _ = pipes
    base = _ours(ours, seed=1, output_type="latent")
    for change in ({"bpm": 90}, {"keyscale": "D minor"}, {"timesignature": "4"}, {"vocal_language": "fr"},
                   {"lyrics": "[chorus]\nlo"}, {"prompt": "loud drums"}):
        moved = (_ours(ours, seed=1, output_type="latent", **change) - base).abs().max()
        assert moved > 100 * LATENT_BOUND, change


def test_guidance_is_the_references_plain_cfg_not_diffusers_apg(pipes, monkeypatch):
    """Guidance 4 (base / sft): the reference's `nega + s * (posi - nega)` with the learned null condition at every
    step. diffusers applies APG instead (0.037 apart here); with its guidance swapped for the plain formula, the
    same loop agrees with difftune to 6.6e-7."""
    import diffusers.pipelines.ace_step.pipeline_ace_step as module

    ours, theirs = pipes
    s, noise = 4.0, _noise(1)
    got = _ours(ours, seed=1, cfg_scale=s)
    apg = _theirs(theirs, noise, guidance_scale=s)
    assert (got - apg).abs().max() > 1e-2

    def plain(pred_cond, pred_uncond, guidance_scale, **_):  # diffusers passes s - 1
        return pred_uncond + (guidance_scale + 1) * (pred_cond - pred_uncond)

    monkeypatch.setattr(module, "normalized_guidance", plain)
    assert (got - _theirs(theirs, noise, guidance_scale=s)).abs().max() < 1e-5
    assert (got - _ours(ours, seed=1)).abs().max() > 1e-2  # guidance did something


def test_the_schedule_is_the_references_and_diffusers(pipes):
    """linspace(1, 0, N + 1)[:-1] shifted by 3 (the reference's set_timesteps_ace_step, diffusers'
    _get_timestep_schedule), difftune's on a 0..1000 scale."""
    ours, theirs = pipes
    for n in (1, 2, 8, 30):
        ours.set_timesteps({}, n)
        t = torch.linspace(1, 0, n + 1)[:-1]
        reference = 3 * t / (1 + 2 * t)
        diffusers = theirs._get_timestep_schedule(num_inference_steps=n, shift=3.0, dtype=torch.float32)
        assert torch.allclose(ours.scheduler.timesteps / 1000, reference, atol=1e-6)
        assert torch.allclose(diffusers, reference, atol=1e-6)


def test_the_templates_are_diffusers(pipes):
    """Caption (instruction, caption, metas) and lyric templates, given every input: diffusers' strings. Left out,
    the metadata differ: difftune takes the reference's defaults, diffusers writes N/A and language en."""
    _, theirs = pipes
    text, lyric = theirs._format_prompt(PROMPT, LYRICS, vocal_language="fr", audio_duration=2.5, bpm=120,
                                        keyscale="C major", timesignature="3")
    assert text == SFT_GEN_PROMPT.format(TEXT2MUSIC, PROMPT, metas(120, "3", "C major", 2.5))
    assert lyric == LYRIC_PROMPT.format("fr", LYRICS)
    assert {k: CALL_PARAMETERS[k] for k in ("bpm", "keyscale", "timesignature", "vocal_language", "duration")} == \
        {"bpm": 100, "keyscale": "B minor", "timesignature": "4", "vocal_language": "unknown", "duration": 60}
    assert "- bpm: N/A\n" in theirs._format_prompt(PROMPT, LYRICS)[0]


def test_a_part_second_rounds_its_frames_as_the_reference(pipes):
    """2.5 s: the reference's round(2.5 * 48000 / 1920) = 62 frames (Python's round half to even), difftune's too;
    diffusers' ceil gives 63."""
    ours, theirs = pipes
    got = _ours(ours, seed=1, output_type="latent", duration=2.5, steps=1)
    assert got.shape == (1, 62, C)
    their = _theirs(theirs, None, output_type="latent", audio_duration=2.5, steps=1,
                    generator=torch.Generator().manual_seed(1))
    assert their.shape == (63, C)
