"""FLUX.2's recognition beyond the shared checks (tests/families/test_recognition.py: the official folders, BFL's
single file, the real-size DiTs and text encoders from their headers): bare weight files without their config.json,
a Mistral-3 too shallow for dev, weights named by hub id going to the family they come from, and a fully trained DiT
saved with `--full_format original` recognised as BFL's file."""

from __future__ import annotations

import shutil

import pytest
import torch

from difftune.core.family import recognise
from difftune.families.flux2 import FAMILY
from difftune.families.flux2.components import DIT_BFL
from difftune.models import ModelConfig
from support.flux2 import DEV, KLEIN_4B, KLEIN_9B, hub_paths, write_tiny_flux2_hub


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return write_tiny_flux2_hub(tmp_path_factory.mktemp("flux2_hub"), dev=True)


def _slots(configs, family=None):
    spec, found = recognise(configs, family, log=lambda *a: None)
    return spec.name, {slot: det for slot, _, det in found}


def _entry(hub, repo, folder):
    paths = hub_paths(hub, repo, folder)
    return ModelConfig(paths if len(paths) > 1 else paths[0])


def test_bare_weights_without_their_config(hub, tmp_path):
    """Weights copied away from their config.json: sizes read off the shapes (depths, widths, guidance embedder)."""
    for repo, folder in ((DEV, "transformer"), (KLEIN_9B, "text_encoder"), (DEV, "text_encoder"), (DEV, "vae")):
        target = tmp_path / repo.replace("/", "_") / folder
        target.mkdir(parents=True)
        for path in hub_paths(hub, repo, folder):
            shutil.copy(path, target)
    name, found = _slots([ModelConfig(sorted(str(p) for p in (tmp_path / DEV.replace("/", "_") / "transformer").glob(
        "*.safetensors"))), ModelConfig(str(next((tmp_path / DEV.replace("/", "_") / "vae").glob("*.safetensors"))))])
    config = found["dit"].config
    assert name == "flux2" and config["num_layers"] == 8 and config["num_single_layers"] == 48
    assert config["guidance_embeds"] is True and config["joint_attention_dim"] == 96
    assert found["vae"].config["latent_channels"] == 32
    for repo, cls, hidden in ((KLEIN_9B, "Qwen3Model", 48), (DEV, "MistralModel", 32)):
        files = sorted(str(p) for p in (tmp_path / repo.replace("/", "_") / "text_encoder").glob("*.safetensors"))
        _, found = _slots([ModelConfig(files if len(files) > 1 else files[0])], "flux2")
        assert found["text_encoder"].spec.class_name == cls and found["text_encoder"].config["hidden_size"] == hidden


def test_a_mistral_too_shallow_for_dev_is_not_its_text_encoder(tmp_path):
    """dev reads hidden states 10, 20 and 30: a Mistral-3 of 26 layers (ERNIE-Image's Ministral-3 3B depth) is
    refused by the family, one of 30 recognised."""
    from difftune.errors import UserError
    from difftune.parts.mistral3 import MISTRAL_SMALL_3_1_TEXT_CONFIG
    from support.parts import mistral_tokenizer, tiny_mistral3, tiny_text_config, write_mistral3_folder

    tok = mistral_tokenizer()
    for layers, fits in ((26, False), (30, True)):
        cfg = {**tiny_text_config(MISTRAL_SMALL_3_1_TEXT_CONFIG, vocab_size=len(tok), layers=layers),
               "tie_word_embeddings": True}
        folder = write_mistral3_folder(tiny_mistral3(cfg, conditional_generation=True), tmp_path / str(layers))
        config = ModelConfig(str(folder / "model.safetensors"))
        if fits:
            assert _slots([config], "flux2")[1]["text_encoder"].config["num_hidden_layers"] == 30
        else:
            with pytest.raises(UserError):
                _slots([config], "flux2")


def test_weights_named_by_hub_id_go_to_the_family_they_come_from(hub, monkeypatch):
    """FLUX.2-dev's text encoder and VAE alone (the dev script's stage 1) also fit ERNIE-Image (a Mistral-3 and the
    FLUX.2 VAE): named by hub id, they go to the family whose `repositories` hold that id; by path, the family
    must be named. A twin family with FLUX.2's components stands in for the other one here."""
    import dataclasses

    from difftune.core import family as registry
    from difftune.errors import UserError

    monkeypatch.setitem(registry._REGISTERED, "twin", dataclasses.replace(FAMILY, name="twin",
                                                                          repositories=("someone/Twin",)))
    monkeypatch.setenv("DIFFTUNE_MODEL_BASE_PATH", str(hub))
    monkeypatch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "true")
    by_id = [ModelConfig(model_id=DEV, origin_file_pattern="text_encoder/*.safetensors"),
             ModelConfig(model_id=DEV, origin_file_pattern="vae/diffusion_pytorch_model.safetensors")]
    assert _slots(by_id)[0] == "flux2"
    with pytest.raises(UserError, match=r"fit several families \(.*flux2.*twin|twin.*flux2"):
        _slots([_entry(hub, DEV, "text_encoder"), _entry(hub, DEV, "vae")])


def test_full_format_original_writes_bfls_single_file(hub, tmp_path):
    """A fully trained klein DiT saved with `--full_format original` is BFL's layout (fused qkv, double_blocks), and
    loads (recognised as BFL's file) to the same tensors as the run saved in diffusers' names."""
    import json

    from safetensors.torch import load_file

    from conftest import run_train
    from difftune.families.flux2.components import convert_bfl_dit
    from support import write_example_dataset
    from support.flux2 import klein_model_paths

    meta = write_example_dataset(tmp_path / "data", n=2, size=(32, 32))
    saved = {}
    for fmt in ("diffusers", "original"):
        run_train("--task", "sft", "--dataset_base_path", tmp_path / "data", "--dataset_metadata_path", meta,
                  "--model_paths", json.dumps(klein_model_paths(hub)), "--tokenizer_path",
                  hub / KLEIN_4B / "tokenizer", "--output_path", tmp_path / fmt, "--trainable_models", "dit",
                  "--learning_rate", 1e-3, "--max_steps", 1, "--seed", 5, "--no_progress", "--max_pixels", 1024,
                  "--torch_dtype", "float32", "--enable_tensorboard_log", "false", "--remove_prefix_in_ckpt",
                  "pipe.dit.", "--full_format", fmt)
        saved[fmt] = next((tmp_path / fmt).glob("*.safetensors"))
    original = load_file(str(saved["original"]))
    assert "double_blocks.0.img_attn.qkv.weight" in original and "single_blocks.19.linear1.weight" in original
    name, found = _slots([ModelConfig(str(saved["original"]))])
    assert name == "flux2" and found["dit"].spec is DIT_BFL
    back, diffusers = convert_bfl_dit(original), load_file(str(saved["diffusers"]))
    assert back.keys() == diffusers.keys() and all(torch.equal(back[k], diffusers[k]) for k in back)
