"""Ideogram-4 against diffusers' Ideogram4Pipeline on the tiny models: the schedule, the prompt's features, and
sampling (the conditional DiT and the unconditional one blended by the guidance scale, the VAE's decode) from the
same initial noise. Also the original-name files load to the weights diffusers' models hold."""

from __future__ import annotations

import pytest
import torch

from difftune.families.ideogram4.scheduler import Ideogram4Scheduler
from difftune.families.ideogram4.units import grid_to_tokens, text_features, tokens_to_grid
from support.ideogram4 import ideogram4_tokenizer, load_tiny_ideogram4, write_tiny_ideogram4_hub

KW = dict(height=48, width=32, num_inference_steps=3)


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return write_tiny_ideogram4_hub(tmp_path_factory.mktemp("ideogram4_hub"))


@pytest.fixture(scope="module")
def ours(hub):
    return load_tiny_ideogram4(hub)


def _diffusers(pipe):
    from diffusers import FlowMatchEulerDiscreteScheduler
    from diffusers import Ideogram4Pipeline as Theirs

    theirs = Theirs(scheduler=FlowMatchEulerDiscreteScheduler(), vae=pipe.vae, text_encoder=pipe.text_encoder,
                    tokenizer=ideogram4_tokenizer(), transformer=pipe.dit, unconditional_transformer=pipe.dit_uncond)
    theirs.set_progress_bar_config(disable=True)
    return theirs


def test_the_schedule_is_diffusers(ours):
    from diffusers.pipelines.ideogram4.pipeline_ideogram4 import _logit_normal_sigmas, _resolution_aware_mu

    sched = Ideogram4Scheduler()
    for h, w, n in ((1024, 1024, 48), (48, 32, 3), (2048, 1536, 20)):
        sched.set_timesteps(n, image_seq_len=(h // 16) * (w // 16))
        theirs = _logit_normal_sigmas(n, _resolution_aware_mu(h, w, 0.0), std=1.5)
        assert torch.equal(sched.sigmas[:-1], theirs) and sched.sigmas[-1] == 0


def test_the_prompt_features_are_diffusers(ours):
    theirs = _diffusers(ours)
    features, *_ = theirs.encode_prompt("a red circle", 2, 2, max_sequence_length=64, device="cpu")
    mine = text_features(ours, "a red circle")
    n = mine.shape[0]
    # diffusers left-pads to max_sequence_length; its text rows are the last n of the first 64
    diff = (features[0, 64 - n:64] - mine).abs().max().item()
    print(f"ideogram4 prompt features vs diffusers: max difference {diff:.2e} over {n} tokens")
    assert mine.shape[1] == 13 * 16 and diff <= 1e-5


@pytest.mark.parametrize("cfg", [1.0, 4.0])
def test_sampling_equals_diffusers(ours, cfg):
    theirs = _diffusers(ours)
    h, w = KW["height"] // 16, KW["width"] // 16
    noise = torch.randn(1, 128, h, w, generator=torch.Generator().manual_seed(3))
    mine = ours.generate({**ours.prompt_values("a red circle", ""), "height": KW["height"], "width": KW["width"],
                          "seed": None, "rand_device": "cpu", "input_image": None, "latents": noise},
                         cfg_scale=cfg, num_inference_steps=KW["num_inference_steps"], given=("latents",),
                         progress=False, output_type="latent")
    out = theirs("a red circle", guidance_scale=cfg, guidance_schedule=None, latents=grid_to_tokens(noise),
                 max_sequence_length=64, output_type="latent", **KW).images
    diff = (mine - tokens_to_grid(out, h, w)).abs().max().item()
    print(f"ideogram4 sampling (cfg {cfg}) vs diffusers' Ideogram4Pipeline: latents max difference {diff:.2e}")
    assert diff <= 1e-4
    # the decode
    img_mine = ours.postprocess(mine, "pt")
    img_theirs = theirs("a red circle", guidance_scale=cfg, guidance_schedule=None, latents=grid_to_tokens(noise),
                        max_sequence_length=64, output_type="pt", **KW).images
    diff = (img_mine - img_theirs).abs().max().item()
    print(f"ideogram4 images (cfg {cfg}) vs diffusers: max difference {diff:.2e}")
    assert diff <= 1e-4


def test_the_unconditional_side_uses_the_unconditional_dit(hub, ours):
    """Without its unconditional DiT the pipeline guides with the DiT itself (the reference's fallback): a different
    result; with cfg 1 the unconditional side never runs."""
    solo = load_tiny_ideogram4(hub, uncond=False)
    assert solo.dit_uncond is None
    args = dict(seed=0, output_type="latent", progress=False, **KW)
    assert not torch.allclose(solo("a red circle", cfg_scale=4.0, **args), ours("a red circle", cfg_scale=4.0, **args))
    assert torch.equal(solo("a red circle", cfg_scale=1.0, **args), ours("a red circle", cfg_scale=1.0, **args))


def test_a_batch_of_prompts_of_different_lengths_equals_diffusers(ours):
    """Two prompts at once: difftune pads the shorter one's features on the right (its own attention segment),
    diffusers on the left; the same result."""
    theirs = _diffusers(ours)
    prompts = ["a red circle", "a small blue square on a wide green field"]
    h, w = KW["height"] // 16, KW["width"] // 16
    noise = torch.randn(2, 128, h, w, generator=torch.Generator().manual_seed(4))
    mine = ours.generate({**ours.prompt_values(prompts, ""), "height": KW["height"], "width": KW["width"],
                          "seed": None, "rand_device": "cpu", "input_image": None, "latents": noise},
                         cfg_scale=3.0, num_inference_steps=KW["num_inference_steps"], given=("latents",),
                         progress=False, output_type="latent")
    out = theirs(prompts, guidance_scale=3.0, guidance_schedule=None, latents=grid_to_tokens(noise),
                 max_sequence_length=96, output_type="latent", **KW).images
    diff = (mine - tokens_to_grid(out, h, w)).abs().max().item()
    print(f"ideogram4 batch of 2 prompts vs diffusers: latents max difference {diff:.2e}")
    assert diff <= 1e-4
