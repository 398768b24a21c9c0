"""Shared tiny FLUX.1 models for the variant tests (written once per session)."""

import pytest
import torch

from support import write_tiny_flux


@pytest.fixture(scope="session")
def flux_repo(tmp_path_factory):
    return write_tiny_flux(tmp_path_factory.mktemp("flux") / "repo", shard=False)


@pytest.fixture(scope="session")
def flux_models(flux_repo):
    """The tiny FLUX.1-dev's models (fp32, eval) and tokenizers, loaded once."""
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextModel, CLIPTokenizer, T5EncoderModel, T5Tokenizer

    vae = AutoencoderKL.from_pretrained(flux_repo / "vae").eval()
    # a near-deterministic posterior (std e^-15), so diffusers' sampled encode equals the mode we take to ~1e-7
    with torch.no_grad():
        half = vae.encoder.conv_out.out_channels // 2
        vae.encoder.conv_out.weight[half:] = 0
        vae.encoder.conv_out.bias[half:] = -30
    return {"dit": FluxTransformer2DModel.from_pretrained(flux_repo / "transformer").eval(), "vae": vae,
            "text_encoder": CLIPTextModel.from_pretrained(flux_repo / "text_encoder").eval(),
            "text_encoder_2": T5EncoderModel.from_pretrained(flux_repo / "text_encoder_2").eval(),
            "tokenizer": CLIPTokenizer.from_pretrained(flux_repo / "tokenizer"),
            "tokenizer_2": T5Tokenizer.from_pretrained(flux_repo / "tokenizer_2")}
