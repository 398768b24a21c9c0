"""FLUX.2-dev (Mistral-3 prompts, embedded guidance) trains the same LoRA in one stage and split (stage 1: Mistral-3
and the VAE; stage 2: the DiT from the cache). The contract suite checks klein; this is dev's path."""

from __future__ import annotations

import json

from safetensors.torch import load_file

from conftest import run_train
from support import write_example_dataset
from support.flux2 import DEV, dev_model_paths, write_tiny_flux2_hub


def test_dev_split_equals_one_stage(tmp_path):
    hub = write_tiny_flux2_hub(tmp_path / "hub", dev=True)
    meta = write_example_dataset(tmp_path / "data", n=2, size=(32, 32))
    paths = dev_model_paths(hub)
    # stage 1's text encoder and VAE alone, as local files, are also ERNIE-Image's kinds (hub ids would tell them
    # apart: FamilySpec.repositories): the family is named
    common = ["--family", "flux2", "--tokenizer_path", hub / DEV / "tokenizer", "--lora_base_model", "dit", "--lora_target_modules",
              "to_q,to_k,to_v,to_qkv_mlp_proj", "--lora_rank", 4, "--learning_rate", 1e-3, "--max_steps", 3,
              "--dataset_repeat", 2, "--seed", 5, "--no_progress", "--max_pixels", 1024, "--torch_dtype", "float32",
              "--enable_tensorboard_log", "false"]
    data = ["--dataset_base_path", tmp_path / "data", "--dataset_metadata_path", meta]
    run_train("--task", "sft", *data, "--model_paths", json.dumps(paths), "--output_path", tmp_path / "one", *common)
    run_train("--task", "sft:data_process", *data, "--model_paths", json.dumps(paths[1:]), "--output_path",
              tmp_path / "cache", *common)
    run_train("--task", "sft:train", "--dataset_base_path", tmp_path / "cache", "--model_paths", json.dumps(paths[:1]),
              "--output_path", tmp_path / "two", *common)
    one = load_file(str(next((tmp_path / "one").glob("*.safetensors"))))
    two = load_file(str(next((tmp_path / "two").glob("*.safetensors"))))
    assert one.keys() == two.keys() and len(one) == 2 * (8 * 3 + 48)
    diff = max((one[k] - two[k]).abs().max().item() for k in one)
    print(f"flux2 dev split vs one stage: LoRA max difference {diff:.2e}")
    assert diff <= 3e-5 and max(v.abs().max().item() for k, v in one.items() if "lora_B" in k) > 1e-4
