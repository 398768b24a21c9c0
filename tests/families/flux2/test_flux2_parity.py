"""FLUX.2 sampling through `Flux2Pipeline.__call__` equals diffusers' Flux2KleinPipeline (distilled klein, no CFG;
klein base with CFG) and Flux2Pipeline (FLUX.2-dev, embedded guidance) on the tiny models (fp32, latents and decoded
images)."""

from __future__ import annotations

import pytest
import torch

from support.flux2 import DEV, KLEIN_4B, KLEIN_BASE_4B, load_tiny_dev, load_tiny_klein, write_tiny_flux2_hub

TOL = 1e-5


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return write_tiny_flux2_hub(tmp_path_factory.mktemp("flux2_hub"), dev=True)


def _klein(hub, dit_repo, distilled):
    from diffusers import (AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline,
                           Flux2Transformer2DModel)
    from transformers import AutoTokenizer, Qwen3ForCausalLM

    repo = hub / KLEIN_4B
    pipe = Flux2KleinPipeline(
        scheduler=FlowMatchEulerDiscreteScheduler.from_pretrained(repo / "scheduler"),
        vae=AutoencoderKLFlux2.from_pretrained(repo / "vae"),
        text_encoder=Qwen3ForCausalLM.from_pretrained(repo / "text_encoder"),
        tokenizer=AutoTokenizer.from_pretrained(repo / "tokenizer"),
        transformer=Flux2Transformer2DModel.from_pretrained(hub / dit_repo / "transformer"),
        is_distilled=distilled).to(torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def _to_vae_latents(pipe, latents):
    """Our (B, 128, H/16, W/16) normalised patch latents as diffusers' `output_type="latent"` returns them."""
    from difftune.parts.flux2_vae import unpatchify

    mean = pipe.vae.bn.running_mean.view(1, -1, 1, 1)
    std = torch.sqrt(pipe.vae.bn.running_var.view(1, -1, 1, 1) + pipe.vae.config.batch_norm_eps)
    return unpatchify(latents * std + mean)


@pytest.mark.parametrize("dit_repo,cfg_scale", [(KLEIN_4B, 1.0), (KLEIN_BASE_4B, 3.0)])
def test_klein_equals_diffusers(hub, dit_repo, cfg_scale):
    ours = load_tiny_klein(hub, dit_repo)
    theirs = _klein(hub, dit_repo, distilled=cfg_scale == 1.0)
    prompts = ["a red circle", "a much longer prompt about a blue square on a green field"]
    kwargs = dict(height=32, width=48, num_inference_steps=3)
    mine = ours(prompts, cfg_scale=cfg_scale, seed=7, output_type="latent", progress=False, **kwargs)
    ref = theirs(prompt=prompts, guidance_scale=cfg_scale, generator=torch.Generator().manual_seed(7),
                 output_type="latent", **kwargs).images
    diff = (_to_vae_latents(ours, mine) - ref).abs().max().item()
    print(f"flux2 klein {dit_repo} cfg {cfg_scale}: max |latents - diffusers| = {diff:.2e}")
    assert mine.shape == (2, 128, 2, 3) and diff <= TOL
    image = ours(prompts[0], cfg_scale=cfg_scale, seed=7, output_type="pt", progress=False, **kwargs)
    ref_image = theirs(prompt=prompts[0], guidance_scale=cfg_scale, generator=torch.Generator().manual_seed(7),
                       output_type="pt", **kwargs).images
    diff = (image - ref_image).abs().max().item()
    print(f"flux2 klein {dit_repo} cfg {cfg_scale}: max |image - diffusers| = {diff:.2e}")
    assert image.shape == ref_image.shape == (1, 3, 32, 48) and diff <= TOL


def test_dev_equals_diffusers(hub):
    from diffusers import Flux2Pipeline as Theirs

    ours = load_tiny_dev(hub)
    theirs = Theirs.from_pretrained(str(hub / DEV), torch_dtype=torch.float32)
    theirs.set_progress_bar_config(disable=True)
    prompts = ["a red circle", "a much longer prompt about a blue square on a green field"]
    kwargs = dict(height=48, width=32, num_inference_steps=3)
    mine = ours(prompts, embedded_guidance=2.5, seed=3, output_type="latent", progress=False, **kwargs)
    ref = theirs(prompt=prompts, guidance_scale=2.5, generator=torch.Generator().manual_seed(3),
                 output_type="latent", **kwargs).images
    # Flux2Pipeline's "latent" output is the packed tokens (B, h*w, 128), normalised
    diff = (mine.flatten(2).transpose(1, 2) - ref).abs().max().item()
    image = ours(prompts[0], embedded_guidance=2.5, seed=3, output_type="pt", progress=False, **kwargs)
    ref_image = theirs(prompt=prompts[0], guidance_scale=2.5, generator=torch.Generator().manual_seed(3),
                       output_type="pt", **kwargs).images
    image_diff = (image - ref_image).abs().max().item()
    # the guidance reaches the DiT: another value moves the result
    other = ours(prompts, embedded_guidance=6.0, seed=3, output_type="latent", progress=False, **kwargs)
    print(f"flux2 dev: max |latents - diffusers| = {diff:.2e}, |image - diffusers| = {image_diff:.2e}; guidance "
          f"2.5 -> 6 moves them by "
          f"{(other - mine).abs().max().item():.2e}")
    assert mine.shape == (2, 128, 3, 2) and diff <= TOL and image_diff <= TOL and (other - mine).abs().max() > 1e-4


def _picture(seed, size):
    from PIL import Image

    g = torch.Generator().manual_seed(seed)
    return Image.fromarray((torch.rand(size[1], size[0], 3, generator=g) * 255).to(torch.uint8).numpy())


def test_klein_edit_images_equal_diffusers(hub):
    """Two reference images of different sizes (multiples of 16, at least 64 and under 1024 x 1024: diffusers keeps
    them as they are, as `edit_image_auto_resize=False` does), CFG on the base model."""
    images = [_picture(1, (96, 64)), _picture(2, (64, 64))]
    ours = load_tiny_klein(hub, KLEIN_BASE_4B)
    theirs = _klein(hub, KLEIN_BASE_4B, distilled=False)
    kwargs = dict(height=32, width=32, num_inference_steps=3)
    mine = ours("make it blue", cfg_scale=2.0, seed=5, edit_image=images, edit_image_auto_resize=False,
                output_type="latent", progress=False, **kwargs)
    ref = theirs(prompt="make it blue", image=images, guidance_scale=2.0, generator=torch.Generator().manual_seed(5),
                 output_type="latent", **kwargs).images
    plain = ours("make it blue", cfg_scale=2.0, seed=5, output_type="latent", progress=False, **kwargs)
    diff = (_to_vae_latents(ours, mine) - ref).abs().max().item()
    print(f"flux2 klein-base edit images: max |latents - diffusers| = {diff:.2e}; the images move them by "
          f"{(mine - plain).abs().max().item():.2e}")
    assert diff <= TOL and (mine - plain).abs().max() > 1e-3
