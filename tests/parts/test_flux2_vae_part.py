"""parts/flux2_vae: the latent layouts and normalisation equal what diffusers' FLUX.2, ERNIE-Image and Ideogram-4
pipelines do, the config read off the weights rebuilds the model, and the official config builds the official
shapes."""

from __future__ import annotations

import pytest
import torch

from difftune.parts import flux2_vae as fv
from support.parts import tiny_flux2_vae


@pytest.fixture(scope="module")
def vae():
    return tiny_flux2_vae()


def test_patchify_matches_the_pipelines_and_inverts():
    from diffusers.pipelines.ernie_image.pipeline_ernie_image import ErnieImagePipeline
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline

    x = torch.randn(2, 4, 6, 8)
    assert torch.equal(fv.patchify(x), Flux2Pipeline._patchify_latents(x))
    assert torch.equal(fv.patchify(x), ErnieImagePipeline._patchify_latents(x))
    p = fv.patchify(x)
    assert p.shape == (2, 16, 3, 4)
    assert torch.equal(fv.unpatchify(p), x)
    assert torch.equal(fv.unpatchify(p), Flux2Pipeline._unpatchify_latents(p))
    # channel c*4 + 2*p + q holds pixel (2i + p, 2j + q) of channel c
    assert p[1, 3 * 4 + 2 + 1, 2, 3] == x[1, 3, 5, 7]


def test_tokens_match_flux2_pack_and_invert():
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline

    x = torch.randn(2, 16, 3, 5)
    t = fv.to_tokens(x)
    assert torch.equal(t, Flux2Pipeline._pack_latents(x))
    assert torch.equal(fv.from_tokens(t, 3, 5), x)


def test_patch_major_tokens_invert_ideogram4_unpacking():
    x = torch.randn(2, 4, 6, 8)
    t = fv.patch_major_tokens(x)
    assert t.shape == (2, 12, 16)
    # Ideogram4Pipeline's decode: view (B, gh, gw, p, p, C), permute (0, 5, 1, 3, 2, 4), view (B, C, H, W)
    z = t.view(2, 3, 4, 2, 2, 4).permute(0, 5, 1, 3, 2, 4).contiguous().view(2, 4, 6, 8)
    assert torch.equal(z, x)
    assert torch.equal(fv.from_patch_major_tokens(t, 6, 8), x)
    assert t[0, 1 * 4 + 2, (2 * 1 + 0) * 4 + 3] == x[0, 3, 3, 4]  # token (1, 2), patch (1, 0), channel 3


def test_encode_equals_flux2_pipeline_and_decode_inverts_normalisation(vae):
    from diffusers.pipelines.flux2.pipeline_flux2 import Flux2Pipeline

    images = torch.rand(1, 3, 32, 48) * 2 - 1
    got = fv.encode(vae, images)
    pipe = Flux2Pipeline.__new__(Flux2Pipeline)
    object.__setattr__(pipe, "vae", vae)  # only the VAE is read
    pipe._patchify_latents = Flux2Pipeline._patchify_latents
    with torch.no_grad():
        want = Flux2Pipeline._encode_vae_image(pipe, images, generator=None)
        assert got.shape == (1, 16, 2, 3)
        assert torch.allclose(got, want, atol=1e-6)
        # the statistics matter: unnormalised latents are far from these
        assert (fv.patchify(vae.encode(images).latent_dist.mode()) - got).abs().max() > 0.1
        decoded = fv.decode(vae, got)
        direct = vae.decode(vae.encode(images).latent_dist.mode()).sample
    assert torch.allclose(decoded, direct, atol=1e-5)


def test_eps_is_the_configs_unless_given(vae):
    _, std = fv.bn_stats(vae)
    assert torch.allclose(std, torch.sqrt(vae.bn.running_var + 1e-4))
    _, std5 = fv.bn_stats(vae, 1e-5)
    assert torch.allclose(std5, torch.sqrt(vae.bn.running_var + 1e-5))
    tokens = torch.randn(2, 5, 16)
    mean, std = fv.bn_stats(vae)
    n = fv.normalize(tokens, mean, std, channel_dim=-1)
    assert torch.allclose(n[1, 2], (tokens[1, 2] - mean) / std)
    assert torch.allclose(fv.denormalize(n, mean, std, channel_dim=-1), tokens, atol=1e-6)


def test_config_from_weights_rebuilds_the_model(vae):
    from diffusers import AutoencoderKLFlux2

    shapes = {k: tuple(v.shape) for k, v in vae.state_dict().items()}
    cfg = fv.flux2_vae_config_from_weights(shapes)
    assert cfg["latent_channels"] == 4 and cfg["block_out_channels"] == [8] * 4 and cfg["layers_per_block"] == 1
    rebuilt = AutoencoderKLFlux2.from_config(cfg)
    assert {k: tuple(v.shape) for k, v in rebuilt.state_dict().items()} == shapes
    # the FLUX.1 AE (no BatchNorm) is not this model
    assert fv.flux2_vae_config_from_weights({k: s for k, s in shapes.items() if not k.startswith("bn.")}) is None


def test_official_config_has_the_markers_and_official_bn_size():
    from diffusers import AutoencoderKLFlux2

    with torch.device("meta"):
        model = AutoencoderKLFlux2.from_config(fv.FLUX2_VAE_CONFIG)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    assert all(k in shapes for k in fv.FLUX2_VAE_MARKER_KEYS)
    assert shapes["bn.running_mean"] == (fv.PATCHED_CHANNELS,) == (128,)
    cfg = fv.flux2_vae_config_from_weights(shapes)
    assert cfg == fv.FLUX2_VAE_CONFIG
