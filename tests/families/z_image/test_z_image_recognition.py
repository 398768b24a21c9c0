"""Z-Image's models are recognised from their weights: the official folders the scripts name, the Fun ControlNet
single files, ComfyUI's single-file DiT (original names, fused qkv), and at the real sizes (from headers alone:
meta tensors) the original-layout DiT, the LDM-layout VAE, SigLIP2 so400m and Qwen3-4B."""

from __future__ import annotations

import pytest
import torch

from difftune.core.family import recognise
from difftune.errors import UserError
from difftune.families.z_image import FAMILY
from difftune.families.z_image.components import (DIT_ORIGINAL, IMAGE_ENCODER, SIGLIP2_SO400M_CONFIG, TEXT_ENCODER,
                                                  VAE_LDM, Z_IMAGE_OMNI_TRANSFORMER_CONFIG, Z_IMAGE_TRANSFORMER_CONFIG,
                                                  original_dit_keys)
from support.z_image import CONTROLNET_FILES, write_single_files
from difftune.models import ModelConfig
from difftune.parts.flux_ae import FLUX1_VAE_CONFIG
from difftune.parts.qwen3 import QWEN3_4B_CONFIG
from support.z_image import (BASE_REPO, CONTROLNET_REPO, OMNI_REPO, TURBO_REPO, hub_entry,
                                            load_tiny_z_image, write_tiny_z_image_hub)
from difftune.models.detect import match_header


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return write_tiny_z_image_hub(tmp_path_factory.mktemp("z_image_hub"))


def _slots(configs, family=None):
    spec, found = recognise(configs, family, log=lambda *a: None)
    return spec.name, {slot: det for slot, _, det in found}


def test_every_official_folder_the_scripts_name(hub):
    configs = [ModelConfig(hub_entry(hub, OMNI_REPO, "transformer")), ModelConfig(hub_entry(hub, OMNI_REPO, "siglip")),
               ModelConfig(hub_entry(hub, TURBO_REPO, "text_encoder")), ModelConfig(hub_entry(hub, TURBO_REPO, "vae"))]
    name, found = _slots(configs)
    assert name == "z_image" and sorted(found) == ["dit", "image_encoder", "text_encoder", "vae"]
    assert found["dit"].config["siglip_feat_dim"] == 32  # Omni-Base's DiT, from its config.json
    for repo in (TURBO_REPO, BASE_REPO):
        name, found = _slots([ModelConfig(hub_entry(hub, repo, "transformer"))])
        assert name == "z_image" and found["dit"].config.get("siglip_feat_dim") is None


@pytest.mark.parametrize("filename", CONTROLNET_FILES)
def test_fun_controlnet_single_files(hub, filename):
    name, found = _slots([ModelConfig(str(hub / CONTROLNET_REPO / filename)), ModelConfig(hub_entry(hub, TURBO_REPO, "transformer"))])
    config = found["controlnet"].config
    assert name == "z_image" and found["controlnet"].source == "weights match the sizes in the weights"
    assert config["control_layers_places"] == [0, 2] and config["control_in_dim"] == 33
    assert config["add_control_noise_refiner"] == "control_noise_refiner"


def test_comfyui_single_file_dit_loads_as_the_official_folder(hub, tmp_path):
    files = write_single_files(hub, tmp_path)
    name, found = _slots([ModelConfig(str(files["dit"]))])
    assert name == "z_image" and found["dit"].spec is DIT_ORIGINAL
    ours = load_tiny_z_image(hub)
    single = type(ours).from_pretrained(torch_dtype=torch.float32, model_configs=[ModelConfig(str(files["dit"]))])
    a, b = ours.dit.state_dict(), single.dit.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _meta_shapes(build, names=lambda sd: sd):
    with torch.device("meta"):
        model = build()
    return {k: tuple(v.shape) for k, v in names(model.state_dict()).items()}


@pytest.mark.parametrize("label,config", [("turbo", Z_IMAGE_TRANSFORMER_CONFIG),
                                          ("omni", Z_IMAGE_OMNI_TRANSFORMER_CONFIG)])
def test_real_size_original_layout_dit(label, config):
    from diffusers import ZImageTransformer2DModel

    kwargs = {k: v for k, v in config.items() if not k.startswith("_")}
    shapes = _meta_shapes(lambda: ZImageTransformer2DModel(**kwargs),
                          lambda sd: {"model.diffusion_model." + k: v for k, v in original_dit_keys(sd).items()})
    assert any(k.endswith("attention.qkv.weight") for k in shapes)
    match = match_header(shapes, FAMILY.components)
    assert match is not None and match.spec is DIT_ORIGINAL and match.config == config


def test_real_size_vae_text_encoder_and_siglip_from_headers():
    from diffusers import AutoencoderKL
    from transformers import Qwen3Config, Qwen3ForCausalLM, Siglip2VisionConfig, Siglip2VisionModel

    from support import _ldm_vae_from_diffusers  # FLUX's AE layout, which Z-Image ships

    vae = _meta_shapes(lambda: AutoencoderKL(**{k: v for k, v in FLUX1_VAE_CONFIG.items() if k[0] != "_"}),
                       lambda sd: _ldm_vae_from_diffusers(sd, 4))
    assert "encoder.down.0.block.0.conv1.weight" in vae
    assert match_header(vae, FAMILY.components).spec is VAE_LDM
    qwen = _meta_shapes(lambda: Qwen3ForCausalLM(Qwen3Config(**QWEN3_4B_CONFIG)),
                        lambda sd: {k: v for k, v in sd.items() if k != "lm_head.weight"})  # tied: not stored
    found = match_header(qwen, FAMILY.components)
    assert found.spec is TEXT_ENCODER and found.config == QWEN3_4B_CONFIG
    untied = {**qwen, "lm_head.weight": (151936, 2560)}  # a file that stores the head: the backbone is loaded
    assert match_header(untied, FAMILY.components).spec is TEXT_ENCODER
    # the official file keeps transformers 4's `vision_model.` level
    siglip = _meta_shapes(lambda: Siglip2VisionModel(Siglip2VisionConfig(**SIGLIP2_SO400M_CONFIG)),
                          lambda sd: {"vision_model." + k: v for k, v in sd.items()})
    found = match_header(siglip, FAMILY.components)
    assert found.spec is IMAGE_ENCODER and found.config["num_hidden_layers"] == 27


def test_two_models_for_one_slot_are_refused_in_one_line(hub):
    with pytest.raises(UserError) as err:
        recognise([ModelConfig(str(hub / CONTROLNET_REPO / CONTROLNET_FILES[0])), ModelConfig(hub_entry(hub, TURBO_REPO, "vae")),
                   ModelConfig(hub_entry(hub, TURBO_REPO, "vae"))], "z_image")
    assert "\n" not in str(err.value) and "AutoencoderKL" in str(err.value)
