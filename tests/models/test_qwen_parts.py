"""The shared parts Krea-2 and Ideogram-4 build on: Qwen3-VL as a text encoder (`parts.qwen3_vl`) and the Qwen-Image
VAE (`parts.qwen_image_vae`). Recognised from the official files' weights (tiny, and at the real 4B/8B sizes from
headers alone), loaded as transformers' Qwen3VLModel with the hidden states of the causal LM it came from."""

from __future__ import annotations

import pytest
import torch

from difftune.models.detect import detect_component
from difftune.models.load import load_component
from difftune.models.detect import match_header
from difftune.parts.qwen3_vl import QWEN3_VL_4B_CONFIG, QWEN3_VL_8B_CONFIG, qwen3_vl_spec
from difftune.parts.qwen_image_vae import QWEN_IMAGE_VAE_CONFIG, qwen_image_vae_spec, vae_decode, vae_encode
from support.qwen_parts import TinyQwen3VLSpec, tiny_qwen3_vl, write_tiny_qwen3_vl, write_tiny_qwen_image_vae

SPEC = qwen3_vl_spec()


@pytest.mark.parametrize("tied", [True, False])
def test_official_layout_loads_as_the_backbone_with_the_same_hidden_states(tmp_path, tied):
    folder = write_tiny_qwen3_vl(tmp_path / "qwen3vl", TinyQwen3VLSpec(tie_word_embeddings=tied))
    det = detect_component(str(folder / "model.safetensors"), [SPEC])
    # config.json names the causal LM: the weights decide, and every size comes from them
    assert det.source == "weights match the sizes in the weights"
    assert det.config["text_config"]["num_hidden_layers"] == 4 and det.config["vision_config"]["depth"] == 2
    assert any(k.startswith("lm_head.") for k in det.shapes) is not tied
    loaded = load_component(str(folder / "model.safetensors"), [SPEC], torch_dtype=torch.float32).module
    assert type(loaded).__name__ == "Qwen3VLModel"
    original = tiny_qwen3_vl(TinyQwen3VLSpec(tie_word_embeddings=tied), vocab_size=loaded.config.text_config.vocab_size)
    ids = torch.tensor([[5, 9, 40, 41, 77, 3]])
    mask = torch.ones_like(ids)
    ours = loaded(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    ref = original.model(input_ids=ids, attention_mask=mask, output_hidden_states=True).hidden_states
    assert len(ours) == 5
    assert max((a - b).abs().max().item() for a, b in zip(ours, ref)) == 0.0


def test_a_saved_backbone_loads_from_its_own_config(tmp_path):
    # diffusers' pipelines save the Qwen3VLModel itself (text_encoder/: its own names, its own config.json)
    model = tiny_qwen3_vl().model
    model.save_pretrained(tmp_path / "text_encoder")
    det = detect_component(str(tmp_path / "text_encoder" / "model.safetensors"), [SPEC])
    assert det.source.endswith("config.json") and det.config["architectures"] == ["Qwen3VLModel"]
    loaded = load_component(str(tmp_path / "text_encoder" / "model.safetensors"), [SPEC], torch_dtype=torch.float32)
    for k, v in model.state_dict().items():
        assert torch.equal(loaded.module.state_dict()[k], v), k


def _official_header(config: dict, tied: bool) -> dict:
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    with torch.device("meta"):
        model = Qwen3VLForConditionalGeneration(Qwen3VLConfig(**{k: v for k, v in config.items()
                                                                 if k != "model_type"}))
    names = {"model.language_model.": "model.language_model.", "model.visual.": "model.visual."}
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    assert all(k.startswith(tuple(names)) or k == "lm_head.weight" for k in shapes)
    return shapes


@pytest.mark.parametrize("label,config,tied", [("Qwen/Qwen3-VL-4B-Instruct", QWEN3_VL_4B_CONFIG, True),
                                               ("Qwen/Qwen3-VL-8B-Instruct", QWEN3_VL_8B_CONFIG, False)])
def test_real_sizes_from_headers(label, config, tied):
    match = match_header(_official_header(config, tied), [SPEC])
    assert match is not None and match.spec is SPEC and match.label == label


def test_a_qwen25_vl_file_is_not_qwen3_vl():
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    with torch.device("meta"):
        model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(
            text_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=2,
                             num_key_value_heads=1, vocab_size=300),
            vision_config=dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64)))
    assert match_header({k: tuple(v.shape) for k, v in model.state_dict().items()}, [SPEC]) is None


def test_qwen_image_vae_part_round_trip(tmp_path):
    folder = write_tiny_qwen_image_vae(tmp_path / "vae")
    spec = qwen_image_vae_spec()
    det = detect_component(str(folder / "diffusion_pytorch_model.safetensors"), [spec])
    assert det.config["latents_std"] == QWEN_IMAGE_VAE_CONFIG["latents_std"]
    vae = load_component(str(folder / "diffusion_pytorch_model.safetensors"), [spec], torch_dtype=torch.float32).module

    class Pipe:  # what the encode/decode read off a pipeline
        device, torch_dtype = torch.device("cpu"), torch.float32

    Pipe.vae = vae
    images = torch.rand(1, 3, 32, 48) * 2 - 1
    latents = vae_encode(Pipe, images)
    assert latents.shape == (1, 16, 4, 6)
    raw = vae.encode(images.unsqueeze(2)).latent_dist.mode()[:, :, 0]
    mean = torch.tensor(QWEN_IMAGE_VAE_CONFIG["latents_mean"]).view(1, -1, 1, 1)
    std = torch.tensor(QWEN_IMAGE_VAE_CONFIG["latents_std"]).view(1, -1, 1, 1)
    assert torch.allclose(latents, (raw - mean) / std, atol=1e-6)
    decoded = vae_decode(Pipe, latents)
    assert torch.allclose(decoded, vae.decode(raw.unsqueeze(2)).sample[:, :, 0], atol=1e-5)
