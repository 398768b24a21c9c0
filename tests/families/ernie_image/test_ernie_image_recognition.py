"""ERNIE-Image's models are recognised from their weights: the official folders the scripts name (the text encoder
beside a multimodal config.json it does not match), ComfyUI's single-file DiT, a text encoder saved by transformers 5,
and at the real sizes (from headers alone: meta tensors) the 8B DiT, the whole Mistral-3 file and the FLUX.2 AE."""

from __future__ import annotations

import pytest
import torch

from difftune.core.family import recognise
from difftune.families.ernie_image import FAMILY
from difftune.families.ernie_image.components import DIT, ERNIE_IMAGE_TRANSFORMER_CONFIG, TEXT_ENCODER, VAE
from difftune.models import ModelConfig
from difftune.models.detect import match_header
from difftune.parts.flux2_vae import FLUX2_VAE_CONFIG
from difftune.parts.mistral3 import MINISTRAL3_3B_TEXT_CONFIG, PIXTRAL_VISION_CONFIG
from support.ernie_image import REPO, ernie_image_model_paths, load_tiny_ernie_image, write_tiny_ernie_image_hub
from support.parts import v4_layout


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return write_tiny_ernie_image_hub(tmp_path_factory.mktemp("ernie_image_hub"))


def _slots(configs, family=None):
    spec, found = recognise(configs, family, log=lambda *a: None)
    return spec.name, {slot: det for slot, _, det in found}


def test_the_official_folders_the_scripts_name(hub):
    name, found = _slots([ModelConfig(e) for e in ernie_image_model_paths(hub)])
    assert name == "ernie_image" and sorted(found) == ["dit", "text_encoder", "vae"]
    assert found["dit"].spec is DIT and found["dit"].config["num_layers"] == 2
    assert found["vae"].spec is VAE and found["vae"].config["latent_channels"] == 32
    # config.json names Mistral3Model: the language model's weights are matched instead, the vision tower left aside
    text = found["text_encoder"]
    assert text.spec is TEXT_ENCODER and text.config["hidden_size"] == 32 and text.config["num_hidden_layers"] == 3
    pipe = load_tiny_ernie_image(hub)
    assert type(pipe.text_encoder).__name__ == "Ministral3Model"
    assert not any("vision" in k for k in pipe.text_encoder.state_dict())


def test_comfyui_single_file_dit_and_a_transformers_5_text_encoder(hub, tmp_path):
    from safetensors.torch import save_file

    ours = load_tiny_ernie_image(hub)
    dit = {"model.diffusion_model." + k: v.contiguous() for k, v in ours.dit.state_dict().items()}
    save_file(dit, str(tmp_path / "ernie-image.safetensors"))
    # transformers 5's Mistral3Model names (`language_model.*`), as a fresh save_pretrained writes them
    text = {"language_model." + k: v.contiguous() for k, v in ours.text_encoder.state_dict().items()}
    save_file(text, str(tmp_path / "text_encoder.safetensors"))
    paths = ernie_image_model_paths(hub)
    configs = [ModelConfig(str(tmp_path / "ernie-image.safetensors")), ModelConfig(str(tmp_path / "text_encoder.safetensors")),
               ModelConfig(paths[2])]
    name, found = _slots(configs)
    assert name == "ernie_image" and found["dit"].spec is DIT and found["text_encoder"].spec is TEXT_ENCODER
    single = type(ours).from_pretrained(torch_dtype=torch.float32, model_configs=configs,
                                        tokenizer_config=ModelConfig(str(hub / REPO / "tokenizer")))
    for slot in ("dit", "text_encoder"):
        a, b = getattr(ours, slot).state_dict(), getattr(single, slot).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _meta_shapes(build, names=lambda sd: sd):
    with torch.device("meta"):
        model = build()
    return {k: tuple(v.shape) for k, v in names(model.state_dict()).items()}


def test_real_size_dit_text_encoder_and_vae_from_headers():
    from diffusers import AutoencoderKLFlux2, ErnieImageTransformer2DModel
    from transformers import Mistral3Config, Mistral3Model

    dit = _meta_shapes(lambda: ErnieImageTransformer2DModel.from_config(ERNIE_IMAGE_TRANSFORMER_CONFIG))
    found = match_header(dit, FAMILY.components)
    assert found.spec is DIT and found.config == ERNIE_IMAGE_TRANSFORMER_CONFIG
    assert sum(torch.Size(s).numel() for s in dit.values()) > 7e9  # the 8B DiT
    comfy = match_header({"model.diffusion_model." + k: v for k, v in dit.items()}, FAMILY.components)
    assert comfy.spec is DIT and comfy.config == ERNIE_IMAGE_TRANSFORMER_CONFIG
    # the whole multimodal model, in transformers 4's names (the official file)
    config = Mistral3Config(text_config=MINISTRAL3_3B_TEXT_CONFIG, vision_config=PIXTRAL_VISION_CONFIG)
    text = _meta_shapes(lambda: Mistral3Model(config), v4_layout)
    assert "language_model.model.layers.25.mlp.up_proj.weight" in text and "vision_tower.ln_pre.weight" in text
    found = match_header(text, FAMILY.components)
    assert found.spec is TEXT_ENCODER and found.config == MINISTRAL3_3B_TEXT_CONFIG
    vae = _meta_shapes(lambda: AutoencoderKLFlux2.from_config(FLUX2_VAE_CONFIG))
    found = match_header(vae, FAMILY.components)
    assert found.spec is VAE and found.config == FLUX2_VAE_CONFIG
