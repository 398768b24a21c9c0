"""The variants' units on tiny Wan2.1 models (VAE, CLIP, UMT5): what each writes, against the reference's formula
for it (`WanVideoUnit_S2V`, `WanVideoUnit_VAP`, `WanVideoUnit_WanToDance_*`, `encode_framewise`)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image

from difftune.data.audio import audio_operator
from difftune.families.wan.dancer.units import (WanDancerFramewiseVideo, WanDancerKeyframes, WanDancerReferenceImage,
                                                framewise_num_frames)
from difftune.families.wan.s2v.units import (WanS2VAudioEmbedder, WanS2VPoseEmbedder, WanS2VReferenceEmbedder,
                                             load_audio_processor, s2v_audio_embeds)
from support.wan.s2v import WAV2VEC_FOLDER, tiny_wav2vec2, write_tiny_wav2vec2
from difftune.families.wan.units import WanImageEmbedderCLIP, vae_encode, video_tensor
from difftune.families.wan.vap.units import WanVAPPromptEmbedder, WanVAPVideoEmbedder
from support.audio import tone, write_audio, write_clip_with_audio

H = W = 32


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    from diffusers import AutoencoderKLWan
    from transformers import CLIPVisionModel, UMT5EncoderModel

    from difftune.models.load import load_tokenizer
    from support import write_tiny_wan

    root = write_tiny_wan(tmp_path_factory.mktemp("wan"), "i2v")
    folder = write_tiny_wav2vec2(root / WAV2VEC_FOLDER)
    models = {"vae": AutoencoderKLWan.from_pretrained(root / "vae").eval(),
              "image_encoder": CLIPVisionModel.from_pretrained(root / "image_encoder").eval(),
              "text_encoder": UMT5EncoderModel.from_pretrained(root / "text_encoder").eval(),
              "audio_encoder": tiny_wav2vec2()}
    from transformers import CLIPImageProcessor

    return SimpleNamespace(**models, models=models, device="cpu", torch_dtype=torch.float32,
                           scheduler=SimpleNamespace(training=True), tokenizer=load_tokenizer(root / "tokenizer"),
                           image_processor=CLIPImageProcessor.from_pretrained(root / "image_processor"),
                           audio_processor=load_audio_processor(folder))


def clip(n, seed=0, size=(W, H)):
    rng = np.random.default_rng(seed)
    return [Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)) for _ in range(n)]


# -- S2V ------------------------------------------------------------------------------------------------------

def test_s2v_audio_from_a_file_and_from_a_clips_track(pipe, tmp_path):
    wave = tone((220.0, 330.0), seconds=0.6, rate=44100)
    write_audio(tmp_path / "speech.wav", wave, 44100)
    write_clip_with_audio(tmp_path / "talk.mp4", clip(9), tone((250.0,), seconds=0.6, rate=16000))
    op = audio_operator(tmp_path)
    unit = WanS2VAudioEmbedder()
    for name in ("speech.wav", "talk.mp4"):
        audio = op(name)
        with torch.no_grad():
            out = unit.process(pipe, audio, 9)["audio_embeds"]
            ref = s2v_audio_embeds(pipe.audio_encoder, pipe.audio_processor, audio, 9)
        assert out.shape == (1, 3, 32, 8) and torch.equal(out, ref)
    assert unit.process(pipe, None, 9) == {}


def test_s2v_pose_latents_are_the_reference_formula(pipe):
    frames = clip(6, seed=1)  # shorter than num_frames - 1 = 8: padded with black
    with torch.no_grad():
        out = WanS2VPoseEmbedder().process(pipe, frames, 9, H, W)["s2v_pose_latents"]
        video = video_tensor(frames, H, W)[:, :, :8]
        video = torch.cat([video, -torch.ones(1, 3, 8 - video.shape[2], H, W)], dim=2)
        ref = vae_encode(pipe, torch.cat([video[:, :, 0:1], video], dim=2))[:, :, 1:]
    assert out.shape == (1, 16, 2, H // 8, W // 8) and torch.allclose(out, ref, atol=1e-6)


def test_s2v_reference_frame_is_the_images_latents(pipe):
    image = clip(1, seed=2)[0]
    with torch.no_grad():
        out = WanS2VReferenceEmbedder().process(pipe, image, H, W, 1)["first_frame_latents"]
        ref = vae_encode(pipe, video_tensor([image], H, W))
    assert out.shape == (1, 16, 1, H // 8, W // 8) and torch.equal(out, ref)
    assert WanS2VReferenceEmbedder.replaces == ("WanImageEmbedderFused",)


# -- Video-As-Prompt -----------------------------------------------------------------------------------------------

def test_vap_clip_gives_the_branch_input(pipe):
    frames = clip(5, seed=3)
    with torch.no_grad():
        out = WanVAPVideoEmbedder().process(pipe, frames, None, 5, H, W, 1)
        latents = vae_encode(pipe, video_tensor(frames, H, W))
        first = video_tensor([frames[0]], H, W)
        y = vae_encode(pipe, torch.cat([first, torch.zeros(1, 3, 4, H, W)], dim=2))
        msk = torch.ones(1, 5, H // 8, W // 8)
        msk[:, 1:] = 0
        msk = torch.cat([torch.repeat_interleave(msk[:, 0:1], repeats=4, dim=1), msk[:, 1:]], dim=1)
        msk = msk.view(1, msk.shape[1] // 4, 4, H // 8, W // 8).transpose(1, 2)
        clip_ref = WanImageEmbedderCLIP().process(pipe, frames[0], None, H, W, 1)["image_embeds"]
    assert out["vap_hidden_state"].shape == (1, 36, 2, H // 8, W // 8)
    assert torch.allclose(out["vap_hidden_state"], torch.cat([latents, msk, y], dim=1), atol=1e-6)
    assert torch.equal(out["vap_clip_feature"], clip_ref)


def test_vap_prompt_defaults_to_the_empty_prompt(pipe):
    unit = WanVAPPromptEmbedder()
    with torch.no_grad():
        none = unit.process(pipe, None)["context_vap"]
        empty = unit.process(pipe, "")["context_vap"]
        text = unit.process(pipe, "a man turns into a toy")["context_vap"]
    assert none.shape == (1, 512, 32) and torch.equal(none, empty) and not torch.equal(text, empty)


# -- Wan-Dancer -----------------------------------------------------------------------------------------------

def test_dancer_keyframes_condition_and_clip(pipe):
    keys = clip(9, seed=4)
    mask = [1, 0, 0, 0, 1, 0, 0, 0, 1]
    with torch.no_grad():
        out = WanDancerKeyframes().process(pipe, keys, mask, 9, H, W)
        z = vae_encode(pipe, video_tensor(keys, H, W))
        clip_ref = WanImageEmbedderCLIP().process(pipe, keys[0], None, H, W, 1)["image_embeds"]
    assert out["condition"].shape == (1, 20, 3, H // 8, W // 8)
    assert torch.equal(out["condition"][:, 4:], z) and torch.equal(out["image_embeds"], clip_ref)
    # the mask: latent frame 0 (frame 0) and the frames 4 and 8 (latent frames 1 and 2, last of their four)
    m = out["condition"][0, :4, :, 0, 0]
    assert m[:, 0].eq(1).all() and m[:, 1].tolist() == [0, 0, 0, 1] and m[:, 2].tolist() == [0, 0, 0, 1]


def test_dancer_reference_image_and_framewise_clip(pipe):
    image = clip(1, seed=5)[0]
    with torch.no_grad():
        ref = WanDancerReferenceImage().process(pipe, [image], H, W)["wantodance_refimage_feature"]
        frames = clip(3, seed=6)
        noise = torch.randn(1, 16, 3, H // 8, W // 8)
        out = WanDancerFramewiseVideo().process(pipe, frames, noise, H, W, True)
        singles = [vae_encode(pipe, video_tensor([f], H, W)) for f in frames]
    assert torch.equal(ref, WanImageEmbedderCLIP().process(pipe, image, None, H, W, 1)["image_embeds"])
    assert out["input_latents"].shape == (1, 16, 3, H // 8, W // 8)
    assert torch.equal(out["input_latents"], torch.cat(singles, dim=2)) and out["latents"] is noise
    assert framewise_num_frames(3) == 9  # noise for 9 frames has 3 latent frames, one per clip frame
