"""A fully trained Wan DiT saved in Wan-AI's original key names (`--full_format original`)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_train
from difftune.errors import UserError
from support import tiny_wan_paths, write_example_dataset, write_tiny_wan


def full_flags(root, meta, out, *more):
    paths = tiny_wan_paths(root)
    return ["--task", "sft", "--family", "wan", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
            "--output_path", out, "--model_paths", json.dumps([paths[k][0] for k in ("transformer", "text_encoder",
                                                                                       "vae")]),
            "--torch_dtype", "float32", "--learning_rate", 1e-3, "--dataset_repeat", 2, "--num_epochs", 1,
            "--seed", 5, "--no_progress", "--enable_tensorboard_log", "false", *more]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    base = tmp_path_factory.mktemp("wanfull")
    return write_tiny_wan(base / "t2v", "t2v"), write_example_dataset(base / "data", n=1, size=(48, 32))


def test_full_dit_in_original_keys_converts_back_to_the_trained_weights(tiny, tmp_path):
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    root, meta = tiny
    run_train(*full_flags(root, meta, tmp_path / "orig", "--trainable_models", "dit", "--full_format", "original"))
    run_train(*full_flags(root, meta, tmp_path / "diff", "--trainable_models", "dit"))
    original = load_file(str(tmp_path / "orig" / "epoch-0.safetensors"))
    trained = load_file(str(tmp_path / "diff" / "epoch-0.safetensors"))
    initial = load_file(tiny_wan_paths(root)["transformer"][0])
    assert {"head.modulation", "blocks.0.self_attn.q.weight", "blocks.0.cross_attn.norm_k.weight",
            "blocks.0.ffn.0.weight", "patch_embedding.weight", "text_embedding.0.weight"} <= original.keys()
    assert not any("attn1" in k or "to_q" in k or "condition_embedder" in k for k in original)
    back = convert_wan_transformer_to_diffusers(dict(original))
    assert back.keys() == trained.keys() == initial.keys()
    assert all(torch.equal(back[k], trained[k]) for k in trained)  # exactly, every tensor
    assert max((trained[k] - initial[k]).abs().max().item() for k in trained) > 1e-4  # it was trained


@pytest.mark.parametrize("more, message", [
    (["--trainable_models", "text_encoder"], "wan has no original key names for text_encoder"),
    (["--lora_base_model", "dit"], "no model is fully trained"),
])
def test_full_format_original_is_refused_where_it_cannot_apply(tiny, tmp_path, more, message):
    root, meta = tiny
    with pytest.raises(UserError, match=message):
        run_train(*full_flags(root, meta, tmp_path / "x", *more, "--full_format", "original"))
    assert not (tmp_path / "x").exists() or not any((tmp_path / "x").glob("*.safetensors"))
