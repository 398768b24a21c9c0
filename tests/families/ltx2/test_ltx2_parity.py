"""LTX-2 sampling against diffusers' `LTX2Pipeline` / `LTX2ImageToVideoPipeline` on the same tiny models (float32,
CPU), both versions: difftune loads the Repackage files and the Gemma-3 folder, diffusers is built from the models
those files were written from. Same prompt and negative prompt, 2 steps, CFG 3, the same starting noise for both
streams (diffusers takes it denormalised).

The reference samples with plain CFG on both streams; diffusers adds spatio-temporal guidance, modality isolation
and guidance rescaling by default, so it runs here with `stg_scale=0, modality_scale=1, guidance_rescale=0` and the
audio guidance equal to the video's (its plain-CFG case). Measured: latents 1e-6 apart (max |latent| ~2-4),
decoded frames 1e-6, the waveform 1e-6 (2.0's 24 kHz vocoder output compared before our resampling to 48 kHz)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from difftune.families.ltx2 import LTX2Pipeline
from difftune.families.ltx2.pipeline import SCHEDULER_CONFIG, _denormalise
from difftune.families.ltx2.units import pack_sound, unpack_sound
from difftune.models import ModelConfig
from support.ltx2 import tiny as T

H = W = 64
FRAMES, STEPS, CFG, RATE = 9, 2, 3.0, 24.0
PROMPT, NEGATIVE = "a red fox", "blurry"
PLAIN_CFG = dict(stg_scale=0.0, modality_scale=1.0, guidance_rescale=0.0, audio_guidance_scale=CFG, audio_stg_scale=0.0,
                 audio_modality_scale=1.0, audio_guidance_rescale=0.0, noise_scale=0.0)
BOUND = 1e-5


@pytest.fixture(scope="module", params=T.VERSIONS)
def pipes(request, tmp_path_factory):
    from diffusers import FlowMatchEulerDiscreteScheduler, LTX2ImageToVideoPipeline
    from diffusers import LTX2Pipeline as DiffusersLTX2

    version = request.param
    root = tmp_path_factory.mktemp(f"ltx2-{version}")
    files = T.write_tiny_ltx2_repackage(root / "repackage", version)
    gemma = T.write_tiny_gemma3(root / "gemma")
    configs = [ModelConfig(str(p)) for p in files.values()]
    configs.append(ModelConfig([str(gemma / s) for s in T.GEMMA3_SHARDS]))
    ours = LTX2Pipeline.from_pretrained(torch_dtype=torch.float32, model_configs=configs,
                                        tokenizer_config=ModelConfig(str(gemma)))
    m = T.tiny_ltx2_models(version)
    parts = dict(vae=m["video_vae"], audio_vae=m["audio_vae"], text_encoder=m["text_encoder"],
                 tokenizer=T.gemma3_tokenizer(), connectors=m["connectors"], transformer=m["dit"], vocoder=m["vocoder"])
    theirs = {}
    for kind, cls in (("t2av", DiffusersLTX2), ("i2av", LTX2ImageToVideoPipeline)):
        theirs[kind] = cls(scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG), **parts)
        theirs[kind].set_progress_bar_config(disable=True)
    return version, ours, theirs


def _noise(seed=1):
    g = torch.Generator().manual_seed(seed)
    video = torch.randn(1, T.VIDEO_LATENT_CHANNELS, (FRAMES - 1) // 8 + 1, H // 32, W // 32, generator=g)
    audio = torch.randn(1, T.AUDIO_LATENT_CHANNELS, round(FRAMES / RATE * 25), T.LATENT_MEL_BINS, generator=g)
    return video, audio


def _denormalise_sound(vae, latents):
    return unpack_sound(pack_sound(latents) * vae.latents_std + vae.latents_mean, latents.shape[-1])


def _ours(ours, video, audio, output_type="latent", **more):
    values = {**ours.prompt_values(PROMPT, NEGATIVE), "height": H, "width": W, "num_frames": FRAMES,
              "frame_rate": RATE, "seed": None, "rand_device": "cpu", "input_image": None, "batch_size": 1,
              "noise": video.clone(), "audio_noise": audio.clone(), **more}
    return ours.generate(values, cfg_scale=CFG, num_inference_steps=STEPS, given={"noise", "audio_noise"},
                         progress=False, output_type=output_type), values


def _theirs(pipe, ours, video, audio, output_type="latent", **more):
    return pipe(prompt=PROMPT, negative_prompt=NEGATIVE, height=H, width=W, num_frames=FRAMES, frame_rate=RATE,
                num_inference_steps=STEPS, guidance_scale=CFG, output_type=output_type, return_dict=False,
                latents=_denormalise(ours.video_vae_decoder, video),
                audio_latents=_denormalise_sound(ours.audio_vae_decoder, audio), **PLAIN_CFG, **more)


def _latent_differences(ours, mine, theirs):
    video = _denormalise(ours.video_vae_decoder, mine["video"])
    audio = _denormalise_sound(ours.audio_vae_decoder, mine["audio"].float())
    assert video.shape == theirs[0].shape and audio.shape == theirs[1].shape
    return (video - theirs[0]).abs().max().item(), (audio - theirs[1]).abs().max().item()


def test_text_to_audio_video_sampling_equals_diffusers(pipes):
    """The latents of both streams, the decoded frames and the waveform."""
    version, ours, theirs = pipes
    video, audio = _noise()
    mine, _ = _ours(ours, video, audio)
    got = _theirs(theirs["t2av"], ours, video, audio)
    dv, da = _latent_differences(ours, mine, got)
    print(f"LTX-{version} t2av: latents max difference video {dv:.2e}, audio {da:.2e} "
          f"(max |latent| {got[0].abs().max().item():.2f} / {got[1].abs().max().item():.2f})")
    assert dv <= BOUND and da <= BOUND

    with torch.no_grad():
        decoded = ours.postprocess(mine, "pt")
    frames, wave = _decoded(theirs["t2av"], got)
    ours_frames = decoded["video"][0].permute(1, 2, 3, 0).numpy()  # (F, H, W, 3) in [0, 1]
    assert ours_frames.shape == frames.shape == (FRAMES, H, W, 3)
    pixels = np.abs(ours_frames - frames).max()
    # our waveform is written at 48 kHz: 2.3's vocoder speaks it, 2.0's 24 kHz is resampled after decoding
    raw = _sound_before_resampling(ours, decoded, mine["audio"])
    assert raw.shape == wave.shape
    sound = (raw - wave.clamp(-1, 1)).abs().max().item()
    print(f"LTX-{version} t2av: frames max difference {pixels:.2e}, waveform {sound:.2e} "
          f"({tuple(wave.shape)} at {ours.audio_vocoder.config.output_sampling_rate} Hz)")
    assert pixels <= BOUND and sound <= BOUND


def _decoded(pipe, latents):
    """diffusers' decoding of its (denormalised) latents, as its pipeline's output_type="np" does at decode
    timestep 0: the frames (F, H, W, 3) in [0, 1] and the vocoder's waveform."""
    with torch.no_grad():
        video = pipe.vae.decode(latents[0], None, return_dict=False)[0]
        frames = pipe.video_processor.postprocess_video(video, output_type="np")[0]
        wave = pipe.vocoder(pipe.audio_vae.decode(latents[1], return_dict=False)[0]).float()
    return frames, wave


def _sound_before_resampling(ours, decoded, latents):
    """The vocoder's own output for these latents: our decoded sound where the vocoder speaks 48 kHz, else its
    waveform before the resampling (checked to be the decoded sound's source)."""
    stream = ours.target.streams[1]
    vocoder = ours.audio_vocoder
    if int(vocoder.config.output_sampling_rate) == stream.rate_out:
        return decoded["audio"].float()
    vae = ours.audio_vae_decoder
    z = _denormalise_sound(vae, latents.float())
    with torch.no_grad():
        raw = vocoder(vae.decode(z, return_dict=False)[0]).float().clamp(-1, 1)
    from difftune.media.audio import resample

    again = torch.from_numpy(resample(raw[0].numpy(), int(vocoder.config.output_sampling_rate), stream.rate_out))
    assert (again.clamp(-1, 1) - decoded["audio"][0]).abs().max().item() <= BOUND
    return raw


def test_image_to_audio_video_sampling_equals_diffusers(pipes):
    """The first frame given (an image at the clip's size: both H.264-compress it at CRF 33): the latents of both
    streams, the first latent frame left as the image's."""
    version, ours, theirs = pipes
    image = Image.fromarray((np.random.RandomState(0).rand(H, W, 3) * 255).astype("uint8"))
    video, audio = _noise(seed=2)
    mine, values = _ours(ours, video, audio, input_image=image)
    first = values["first_frame_latents"]
    assert torch.equal(mine["video"][:, :, :1], first)  # the clean first frame is the output's
    start = video.clone()
    start[:, :, :1] = first  # diffusers keeps given latents' first frame as the condition
    got = _theirs(theirs["i2av"], ours, start, audio, image=image)
    dv, da = _latent_differences(ours, mine, got)
    print(f"LTX-{version} i2av: latents max difference video {dv:.2e}, audio {da:.2e}")
    assert dv <= BOUND and da <= BOUND
    # not blind: without the image the video moves far past the bound
    plain, _ = _ours(ours, video, audio)
    assert (plain["video"][:, :, 1:] - mine["video"][:, :, 1:]).abs().max().item() > 1e3 * BOUND
