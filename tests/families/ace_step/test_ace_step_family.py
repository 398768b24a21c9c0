"""ACE-Step 1.5 on tiny random models: the release's single file recognised and split, the silence latent read
safely, the reference's units (caption, lyrics and metadata reach the condition), sampling, the loss, and the LoRA
layouts read back."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
from safetensors.torch import save_file

from difftune.errors import UserError
from difftune.families.ace_step import FAMILY, AceStepPipeline, load_silence_latent
from difftune.families.ace_step.components import (COMPONENTS, original_conditioner_keys, original_dit_keys,
                                                   to_diffusers, to_original)
from difftune.families.ace_step.lora import ace_step_lora_native_names, convert_original_ace_step_lora
from difftune.training.losses import flow_match_sft_loss, sample_generator

C = 8


def _tiny(seed: int = 0):
    from diffusers import AceStepTransformer1DModel, AutoencoderOobleck
    from diffusers.pipelines.ace_step.modeling_ace_step import AceStepConditionEncoder
    from transformers import Qwen3Config, Qwen3Model

    from support.z_image.tiny import z_image_tokenizer

    torch.manual_seed(seed)
    dit = AceStepTransformer1DModel(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=16, in_channels=3 * C, audio_acoustic_hidden_dim=C,
                                    patch_size=2, sliding_window=4, encoder_hidden_size=24)
    cond = AceStepConditionEncoder(hidden_size=24, intermediate_size=48, text_hidden_dim=16, timbre_hidden_dim=C,
                                   num_lyric_encoder_hidden_layers=1, num_timbre_encoder_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1, head_dim=12, sliding_window=4)
    tok = z_image_tokenizer()
    te = Qwen3Model(Qwen3Config(vocab_size=len(tok), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                num_attention_heads=2, num_key_value_heads=1, head_dim=8))
    vae = AutoencoderOobleck(encoder_hidden_size=2 * C, downsampling_ratios=[2, 4, 4, 6, 10],
                             channel_multiples=[1, 1, 1, 1, 1], decoder_channels=8, decoder_input_channels=C,
                             audio_channels=2, sampling_rate=48000)
    pipe = AceStepPipeline()
    pipe.dit, pipe.conditioner, pipe.text_encoder, pipe.vae = dit, cond, te, vae
    pipe.tokenizer, pipe.silence_latent = tok, torch.randn(1, 800, C)
    return pipe


@pytest.fixture(scope="module")
def pipe():
    return _tiny()


def test_original_names_map_both_ways():
    for original in ("layers.3.self_attn.q_proj", "layers.0.cross_attn.o_proj.weight", "layers.1.self_attn.k_norm",
                     "proj_in.1.weight", "proj_out.1.bias", "layers.2.mlp.gate_proj"):
        assert to_original(to_diffusers(original)) == original
    assert to_diffusers("layers.0.cross_attn.o_proj") == "layers.0.cross_attn.to_out.0"
    assert to_diffusers("proj_in.1.weight") == "proj_in_conv.weight"


def test_the_release_file_is_recognised_as_the_dit_and_its_condition_encoder(pipe, tmp_path):
    from difftune.models.detect import detect_components

    state = {**original_dit_keys(pipe.dit.state_dict()), **original_conditioner_keys(pipe.conditioner.state_dict()),
             "tokenizer.quantizer.project_in.weight": torch.randn(4, 4),
             "detokenizer.proj_out.weight": torch.randn(4, 4)}
    assert all(k.startswith(("decoder.", "encoder.", "tokenizer.", "detokenizer.")) or k == "null_condition_emb"
               for k in state)
    path = tmp_path / "acestep-v15-turbo" / "model.safetensors"
    path.parent.mkdir()
    save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    found = {d.spec.name: d for d in detect_components(str(path), COMPONENTS)}
    assert set(found) == {"dit", "conditioner"}
    assert found["dit"].config["hidden_size"] == 32 and found["dit"].config["encoder_hidden_size"] == 24
    assert found["conditioner"].config["timbre_hidden_dim"] == C


def test_the_silence_latent_is_one_tensor_read_without_unpickling(tmp_path):
    good = tmp_path / "silence_latent.pt"
    torch.save(torch.randn(1, C, 30), good)
    assert tuple(load_silence_latent(good).shape) == (1, 30, C)  # transposed to (1, frames, channels)
    assert tuple(load_silence_latent(tmp_path).shape) == (1, 30, C)  # the folder beside the DiT

    ran = tmp_path / "ran"

    class Hostile:
        def __reduce__(self):
            return (open, (str(ran), "w"))

    bad = tmp_path / "bad" / "silence_latent.pt"
    bad.parent.mkdir()
    bad.write_bytes(pickle.dumps(Hostile()))
    with pytest.raises(UserError, match="silence_latent.pt"):
        load_silence_latent(bad)
    assert not ran.exists()
    with pytest.raises(UserError, match="no silence_latent.pt beside the DiT's weights: pass --silence_latent_path"):
        empty = tmp_path / "empty"
        empty.mkdir()
        load_silence_latent(empty)  # a folder without it
    wrong = tmp_path / "wrong.pt"
    torch.save(torch.randn(C, 30), wrong)
    with pytest.raises(UserError, match=r"is \(1, channels, frames\)"):
        load_silence_latent(wrong)


def _row(**over):
    wave = torch.linspace(-0.3, 0.3, 2 * 48000 + 700).repeat(2, 1)  # 2.01 s: trained as 2 s
    return {"audio": wave, "prompt": "rock, guitar", "lyrics": "[verse]\nhey", "bpm": 120, "_row": 0, **over}


def _condition(pipe, **over):
    values = pipe.training_inputs(_row(**over))
    pipe.run_units(values)
    return values


def test_a_training_row_gives_whole_seconds_and_every_column_reaches_the_condition(pipe):
    base = _condition(pipe)
    assert base["duration"] == 2  # floor(96700 / 48000)
    assert tuple(base["input_latents"].shape) == (1, 50, C) and tuple(base["context_latents"].shape) == (1, 50, 2 * C)
    assert torch.equal(base["context_latents"][0, :, C:], torch.ones(50, C))  # the chunk mask
    assert torch.allclose(base["context_latents"][0, :, :C], pipe.silence_latent[0, :50])
    for change in ({"lyrics": "[verse]\nho"}, {"prompt": "jazz, piano"}, {"bpm": 90}, {"keyscale": "D minor"},
                   {"vocal_language": "en"}):
        other = _condition(pipe, **change)
        states, ref = other["encoder_hidden_states"], base["encoder_hidden_states"]
        assert states.shape != ref.shape or not torch.allclose(states, ref), change
    # an empty metadata cell is the reference's default
    assert torch.equal(_condition(pipe, keyscale=float("nan"))["encoder_hidden_states"],
                       _condition(pipe, keyscale="C major")["encoder_hidden_states"])
    with pytest.raises(UserError, match="no 'lyrics' column.*Instrumental"):
        pipe.training_inputs({k: v for k, v in _row().items() if k != "lyrics"})


def test_the_loss_trains_the_flow_at_the_drawn_timestep(pipe):
    values = _condition(pipe)
    loss = flow_match_sft_loss(pipe, values, [sample_generator(0, 0, 0)], {})
    again = flow_match_sft_loss(pipe, values, [sample_generator(0, 0, 0)], {})
    assert math.isfinite(float(loss)) and float(loss) > 0 and torch.equal(loss, again)
    loss.backward()
    assert pipe.dit.proj_in_conv.weight.grad is not None
    pipe.dit.zero_grad(set_to_none=True)


def test_a_padded_batch_denoises_as_its_samples_alone(pipe):
    a, b = _condition(pipe), _condition(pipe, lyrics="[verse]\na much longer line of lyrics here")
    n = max(a["encoder_hidden_states"].shape[1], b["encoder_hidden_states"].shape[1])
    pad = lambda v: torch.nn.functional.pad(v, (0, 0, 0, n - v.shape[1]))  # noqa: E731
    mask = torch.zeros(2, n, dtype=torch.bool)
    mask[0, :a["encoder_hidden_states"].shape[1]] = True
    mask[1, :b["encoder_hidden_states"].shape[1]] = True
    latents, t = torch.randn(2, 50, C), torch.tensor([500.0, 500.0])
    with torch.no_grad():
        both = pipe.model_fn(latents, t, torch.cat([pad(a["encoder_hidden_states"]), pad(b["encoder_hidden_states"])]),
                             torch.cat([a["context_latents"], b["context_latents"]]), mask)
        alone = pipe.model_fn(latents[1:], t[1:], b["encoder_hidden_states"], b["context_latents"])
    assert torch.allclose(both[1:], alone, atol=1e-6)


def test_sampling_gives_stereo_48khz_at_a_minus_one_db_peak_and_is_seeded(pipe):
    out = pipe("a calm piano piece", lyrics="la la", duration=2, seed=1, num_inference_steps=2, progress=False)
    again = pipe("a calm piano piece", lyrics="la la", duration=2, seed=1, num_inference_steps=2, progress=False)
    assert out.shape == (2, 96000) and (out == again).all()
    assert abs(abs(out).max() - 10 ** (-1 / 20)) < 1e-4
    schedule = pipe.scheduler.sigmas[:-1]
    raw = torch.linspace(1, 0, 3)[:-1]
    assert torch.allclose(schedule, 3 * raw / (1 + 2 * raw))  # the reference's ACE-Step table, shift 3


def _lora(dit):
    from difftune.lora.inject import inject_lora, lora_state_dict

    targets = "to_q,to_k,to_v,to_out.0,gate_proj,up_proj,down_proj"
    inject_lora(dit, targets.split(","), rank=4, alpha=4)
    torch.manual_seed(1)
    for name, p in dit.named_parameters():
        if "lora_" in name:
            p.data.normal_()
    return lora_state_dict(dit)


@pytest.mark.parametrize("layout", ["diffusers", "reference", "comfyui", "kohya"])
def test_every_lora_layout_reads_back_to_the_trained_update(layout, tmp_path):
    from difftune.lora import canonical_lora_keys, load_lora_file, save_lora
    from safetensors import safe_open

    pipe = _tiny(seed=3)
    sd = canonical_lora_keys(_lora(pipe.dit))
    path = save_lora(tmp_path / "lora.safetensors", {"dit": sd}, {"dit": (4, 4, ["to_q"])}, layout=layout,
                     denoiser="dit", native_names=FAMILY.lora_native_names,
                     reference_names=FAMILY.lora_reference_names)
    with safe_open(str(path), "pt") as f:
        keys = sorted(f.keys())
    expected_first = {"diffusers": "transformer.layers.0.cross_attn.to_k.lora_A.weight",
                      "reference": "layers.0.cross_attn.k_proj.lora_A.weight",
                      "comfyui": "diffusion_model.decoder.layers.0.cross_attn.k_proj.alpha",
                      "kohya": "lora_unet_decoder_layers_0_cross_attn_k_proj.alpha"}[layout]
    assert keys[0] == expected_first
    lora = load_lora_file(path, converters=FAMILY.lora_converters)
    comp = lora.components.get("transformer") or lora.components.get("")
    assert comp is not None


def test_the_native_names_are_the_release_files_and_read_back():
    sd = {"layers.0.self_attn.to_q.lora_A.weight": torch.ones(2, 4), "layers.0.self_attn.to_q.lora_B.weight":
          torch.ones(4, 2), "layers.1.mlp.down_proj.lora_A.weight": torch.ones(2, 8)}
    native, alphas = ace_step_lora_native_names(sd, {"layers.0.self_attn.to_q": 2.0})
    assert set(native) == {"decoder.layers.0.self_attn.q_proj.lora_A.weight",
                           "decoder.layers.0.self_attn.q_proj.lora_B.weight",
                           "decoder.layers.1.mlp.down_proj.lora_A.weight"}
    assert alphas == {"decoder.layers.0.self_attn.q_proj": 2.0}
    official = {f"base_model.model.{k[len('decoder.'):]}": v for k, v in native.items()}
    back = convert_original_ace_step_lora(official)
    assert set(back) == {f"transformer.{k}" for k in sd}
    assert convert_original_ace_step_lora({"transformer.layers.0.self_attn.to_q.lora_A.weight": torch.ones(1)}) is None
