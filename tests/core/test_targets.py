"""What a family generates is its `Target` (core/target.py): the toy families of the other targets train, validate
and sample through the shared code with no edit outside their own package (support/toys): audio (wav in and out), a
clip with its sound track (two streams, one loss each, an mp4 with sound out), and epsilon- / v-prediction images
whose loss and sampling are diffusers' DDPM / DDIM on the same tensors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import support.toys  # noqa: F401  (registers the toy families)
from conftest import run_train
from difftune.cli.sample import main as sample
from difftune.core.family import get_family
from difftune.core.target import EPSILON, FLOW, ImageStream, Target
from difftune.errors import UserError
from difftune.media.audio import probe_audio, read_audio
from difftune.media.video import count_frames
from difftune.models import ModelConfig
from support import tiny_family

COMMON = ("--torch_dtype", "float32", "--learning_rate", 1e-3, "--seed", 5, "--no_progress",
          "--enable_tensorboard_log", "false", "--lora_base_model", "dit", "--lora_target_modules", "mlp",
          "--lora_rank", 4, "--validation_prompts", "a low tone|a high tone", "--validation_inference_steps", 2,
          "--validation_size", 32)


def _trained(name, root):
    t = tiny_family(name, root / "models")
    meta = t.write_dataset(root / "data")
    out = root / "out"
    run_train("--task", "sft", "--family", name, "--model_paths", json.dumps(t.model_paths), "--dataset_base_path",
              meta.parent, "--dataset_metadata_path", meta, "--output_path", out, "--max_steps", 2, *t.flags, *COMMON)
    return t, out


def test_an_audio_family_trains_validates_and_samples_wav(tmp_path, capsys):
    from support.toys.audio import RATE, SECONDS

    t, out = _trained("toy_audio", tmp_path)
    lora = out / "step-2.safetensors" if (out / "step-2.safetensors").exists() else next(out.glob("*.safetensors"))
    names = sorted(p.name for p in (out / "validation").glob("step-*"))
    assert names == ["step-000002-0.wav", "step-000002-1.wav", "step-000002.png"]  # each prompt's audio, the picture
    assert probe_audio(out / "validation" / names[0]).sample_rate == RATE
    capsys.readouterr()
    assert sample(["--family", "toy_audio", "--model_paths", json.dumps(t.model_paths), "--prompt", "a tone",
                   "--lora", str(lora), "--num_inference_steps", "2", "--torch_dtype", "float32", "--device", "cpu",
                   "--output", str(tmp_path / "tone")]) == 0
    written = tmp_path / "tone.wav"
    assert capsys.readouterr().out.split() == [str(written)]
    wave = read_audio(written, RATE)
    assert probe_audio(written).sample_rate == RATE and len(wave) == round(SECONDS * RATE)
    assert np.abs(wave).max() > 0
    with pytest.raises(UserError, match=r"--output a\.png: the toy_audio family makes audio: name a \.wav/\.flac file"):
        sample(["--family", "toy_audio", "--model_paths", json.dumps(t.model_paths), "--prompt", "p", "--output",
                "a.png"])
    with pytest.raises(UserError, match=r"--num_frames: not used: the toy_audio family trains on audio"):
        sample(["--family", "toy_audio", "--model_paths", json.dumps(t.model_paths), "--prompt", "p", "--num_frames",
                "5"])


def test_a_clip_with_sound_trains_one_loss_per_stream_and_samples_an_mp4_with_its_sound(tmp_path, capsys):
    from difftune.training.losses import flow_match_sft_loss, sample_generator
    from support.toys.joint import FPS, FRAMES, RATE

    t, out = _trained("toy_av", tmp_path)
    names = sorted(p.name for p in (out / "validation").glob("step-*"))
    # the clips' frames and animation, each prompt's sound and its waveform
    assert names == ["step-000002-audio-0.wav", "step-000002-audio-1.wav", "step-000002-audio.png",
                     "step-000002.gif", "step-000002.png"]
    capsys.readouterr()
    assert sample(["--family", "toy_av", "--model_paths", json.dumps(t.model_paths), "--prompt", "a clip",
                   "--num_inference_steps", "2", "--torch_dtype", "float32", "--device", "cpu", "--fps", str(FPS),
                   "--output", str(tmp_path / "clip.mp4")]) == 0
    clip = tmp_path / "clip.mp4"
    assert count_frames(clip) == FRAMES
    sound = probe_audio(clip)
    assert sound.sample_rate == RATE and sound.codec == "aac" and abs(sound.duration - FRAMES / FPS) < 0.15

    # the loss is the sum of the two streams' losses, each at the sample's one timestep with its own noise (drawn
    # from the sample's generator in stream order)
    from difftune.core.build import build_pipeline

    pipe = build_pipeline(get_family("toy_av"), [ModelConfig(p) for p in t.model_paths], device="cpu",
                          torch_dtype=torch.float32)
    pipe.scheduler.set_training()
    g = torch.Generator().manual_seed(0)
    values = {"input_latents": torch.randn(1, 4, FRAMES, 8, 8, generator=g),
              "audio_input_latents": torch.randn(1, 4, 40, generator=g), "prompt_emb": torch.randn(1, 16, 16)}
    loss = flow_match_sft_loss(pipe, values, [sample_generator(0, 0, 0)], {})
    drawn = sample_generator(0, 0, 0)
    sigma, timestep, weight = pipe.scheduler.sample_training(1, drawn, image_seq_len=8 * 8 * FRAMES // 4)
    x0 = {"video": values["input_latents"], "audio": values["audio_input_latents"]}
    noise = {k: torch.randn(v.shape[1:], generator=drawn)[None] for k, v in x0.items()}
    pred = pipe.model_fn(latents=pipe.scheduler.add_noise(x0["video"], noise["video"], sigma),
                         audio_latents=pipe.scheduler.add_noise(x0["audio"], noise["audio"], sigma), timestep=timestep,
                         prompt_emb=values["prompt_emb"])
    parts = {k: ((pred[k] - (noise[k] - x0[k])).pow(2).mean() * weight).item() for k in x0}
    assert all(v > 0 for v in parts.values())
    assert loss.item() == pytest.approx(parts["video"] + parts["audio"], rel=1e-5)


@pytest.mark.parametrize("name,prediction", [("toy_eps", "epsilon"), ("toy_v", "v_prediction")])
def test_epsilon_and_v_prediction_train_and_sample_as_diffusers_ddpm_and_ddim(name, prediction, tmp_path):
    from diffusers import DDIMScheduler, DDPMScheduler

    from difftune.core.build import build_pipeline
    from difftune.training.losses import flow_match_sft_loss, sample_generator

    t = tiny_family(name, tmp_path / "models")
    spec = get_family(name)
    assert spec.target.prediction == prediction
    pipe = build_pipeline(spec, [ModelConfig(p) for p in t.model_paths], device="cpu", torch_dtype=torch.float32)
    config = dict(num_train_timesteps=1000, beta_start=0.00085, beta_end=0.012, beta_schedule="scaled_linear",
                  clip_sample=False, prediction_type=prediction)

    # training: DDPM's noising and target at the drawn timestep
    pipe.scheduler.set_training()
    g = torch.Generator().manual_seed(1)
    x0, emb = torch.randn(2, 4, 8, 6, generator=g), torch.randn(2, 16, 16, generator=g)
    loss = flow_match_sft_loss(pipe, {"input_latents": x0, "prompt_emb": emb},
                               [sample_generator(3, 0, i) for i in range(2)], {})
    ddpm = DDPMScheduler(**config)
    draws = [sample_generator(3, 0, i) for i in range(2)]
    steps = torch.cat([torch.randint(0, 1000, (1,), generator=d) for d in draws])
    noise = torch.stack([torch.randn(x0.shape[1:], generator=d) for d in draws])
    target = noise if prediction == "epsilon" else ddpm.get_velocity(x0, noise, steps)
    pred = pipe.model_fn(latents=ddpm.add_noise(x0, noise, steps), timestep=steps, prompt_emb=emb)
    assert loss.item() == pytest.approx((pred - target).pow(2).mean().item(), rel=1e-6)
    assert loss.item() > 0

    # sampling: each step is diffusers' DDIM step on the same model output
    out = pipe("a prompt", height=32, width=24, num_inference_steps=3, seed=7, output_type="latent", progress=False)
    ddim = DDIMScheduler(**config, set_alpha_to_one=False, steps_offset=1)
    ddim.set_timesteps(3)
    latents = torch.randn(1, 4, 8, 6, generator=torch.Generator("cpu").manual_seed(7))
    prompt = pipe.run_units({"prompt": ["a prompt"], "negative_prompt": [""], "batch_size": 1, "height": 32,
                             "width": 24, "seed": 7}, units=[u for u in pipe.units if "prompt" in u.cfg_inputs])
    for t_ in ddim.timesteps:
        model_out = pipe.model_fn(latents=latents, timestep=t_.expand(1), prompt_emb=prompt["prompt_emb"])
        latents = ddim.step(model_out, t_, latents, eta=0.0).prev_sample
    assert torch.allclose(out, latents, atol=1e-6)


def test_a_target_refuses_what_it_cannot_be():
    with pytest.raises(TypeError, match="unknown prediction type 'x0'"):
        Target((ImageStream(),), prediction="x0")
    with pytest.raises(TypeError, match="distinct names"):
        Target((ImageStream(), ImageStream()))
    assert Target((ImageStream(),)).prediction == FLOW


def test_a_scheduler_that_trains_another_prediction_is_refused(tmp_path):
    from difftune.core.build import build_pipeline
    from difftune.schedulers import FlowMatchScheduler
    from difftune.training.losses import flow_match_sft_loss, sample_generator

    t = tiny_family("toy_eps", tmp_path / "models")
    pipe = build_pipeline(get_family("toy_eps"), [ModelConfig(p) for p in t.model_paths], device="cpu",
                          torch_dtype=torch.float32)
    assert pipe.target.prediction == EPSILON
    pipe.scheduler = FlowMatchScheduler()
    pipe.scheduler.set_training()
    with pytest.raises(UserError, match="predicts epsilon, but its scheduler \\(FlowMatchScheduler\\) trains flow"):
        flow_match_sft_loss(pipe, {"input_latents": torch.zeros(1, 4, 2, 2), "prompt_emb": torch.zeros(1, 16, 16)},
                            [sample_generator(0, 0, 0)], {})
