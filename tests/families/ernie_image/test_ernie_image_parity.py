"""ERNIE-Image sampling through `ErnieImagePipeline.__call__` equals diffusers' ErnieImagePipeline on the tiny
models (fp32): the latents, and the decoded images (the BatchNorm un-normalisation and unpatching included)."""

from __future__ import annotations

import pytest
import torch

from support.ernie_image import REPO, load_tiny_ernie_image, write_tiny_ernie_image_hub

TOL = 1e-5


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return write_tiny_ernie_image_hub(tmp_path_factory.mktemp("ernie_image_hub"))


@pytest.fixture(scope="module")
def pipes(hub):
    from diffusers import (AutoencoderKLFlux2, ErnieImagePipeline, ErnieImageTransformer2DModel,
                           FlowMatchEulerDiscreteScheduler)
    from transformers import AutoTokenizer, Mistral3Model

    from difftune.parts.mistral3 import mistral3_model_key
    from safetensors.torch import load_file

    repo = hub / REPO
    # diffusers' class is the whole multimodal Mistral3Model; the official file is in transformers 4's names
    text_encoder = Mistral3Model.from_pretrained(repo / "text_encoder").eval()
    state = {mistral3_model_key(k): v for k, v in load_file(str(repo / "text_encoder" / "model.safetensors")).items()}
    assert text_encoder.load_state_dict(state, strict=True)
    theirs = ErnieImagePipeline(transformer=ErnieImageTransformer2DModel.from_pretrained(repo / "transformer"),
                                vae=AutoencoderKLFlux2.from_pretrained(repo / "vae"), text_encoder=text_encoder,
                                tokenizer=AutoTokenizer.from_pretrained(repo / "tokenizer"),
                                scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(repo / "scheduler"))
    theirs.set_progress_bar_config(disable=True)
    return load_tiny_ernie_image(hub), theirs


def _noise(seed, batch, h, w):
    from difftune.core.latents import seeded_noise

    return seeded_noise((128, h // 16, w // 16), seed, batch, device="cpu")


@pytest.mark.parametrize("cfg_scale", [1.0, 4.0])
def test_text_to_image_equals_diffusers(pipes, cfg_scale):
    ours, theirs = pipes
    prompts = ["a red circle", "a much longer prompt about a blue square on a green field"]
    mine = ours(prompts, negative_prompt="blurry", cfg_scale=cfg_scale, height=32, width=48, num_inference_steps=3,
                seed=7, output_type="latent", progress=False)
    ref = theirs(prompts, negative_prompt="blurry", guidance_scale=cfg_scale, height=32, width=48,
                 num_inference_steps=3, latents=_noise(7, 2, 32, 48), output_type="latent", use_pe=False).images
    diff = (mine - ref).abs().max().item()
    print(f"ernie-image t2i cfg {cfg_scale}: max |latents - diffusers| = {diff:.2e}")
    assert mine.shape == (2, 128, 2, 3) and diff <= TOL
    # the steps moved the latents: equal noise alone would not pass
    assert (ref - _noise(7, 2, 32, 48)).abs().max() > 0.1


def test_decoded_images_equal_diffusers(pipes):
    ours, theirs = pipes
    mine = ours("a fox", height=32, width=32, num_inference_steps=2, seed=3, output_type="pt", progress=False)
    ref = theirs("a fox", height=32, width=32, num_inference_steps=2, latents=_noise(3, 1, 32, 32), output_type="pt",
                 use_pe=False).images
    diff = (mine - ref).abs().max().item()
    print(f"ernie-image decoded: max |image - diffusers| = {diff:.2e}")
    assert mine.shape == ref.shape == (1, 3, 32, 32) and diff <= TOL


def test_prompt_embeddings_equal_diffusers_encode_prompt(pipes):
    from difftune.families.ernie_image.prompt import encode_prompt

    ours, theirs = pipes
    for prompt in ("a red fox in the snow", ""):
        with torch.no_grad():
            want = theirs.encode_prompt(prompt, device="cpu")[0]
            got = encode_prompt(ours, prompt)
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-6)
    assert want.shape[0] == 1  # the empty prompt: <s> alone


def test_input_image_latents_are_the_flux2_encoding(pipes):
    """Training latents: the posterior mode, patched 2x2, normalised with the trained eps (1e-5) diffusers'
    pipeline un-normalises with, so decode(encode(x)) is the VAE's own round trip."""
    from difftune.families.ernie_image.units import vae_encode

    ours, theirs = pipes
    images = torch.rand(1, 3, 32, 48) * 2 - 1
    with torch.no_grad():
        latents = vae_encode(ours, images)
        z = theirs.vae.encode(images).latent_dist.mode()
        patched = theirs._patchify_latents(z)
        mean = theirs.vae.bn.running_mean.view(1, -1, 1, 1)
        std = torch.sqrt(theirs.vae.bn.running_var.view(1, -1, 1, 1) + 1e-5)
        assert torch.allclose(latents, (patched - mean) / std, atol=1e-6)
        assert torch.allclose(ours.decode(latents), theirs.vae.decode(z).sample, atol=1e-5)
