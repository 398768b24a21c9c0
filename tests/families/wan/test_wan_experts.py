"""`--train_experts both`: Wan2.2 A14B's two expert LoRAs in one command, equal to the reference's two runs."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_train
from difftune.errors import UserError
from support import tiny_wan_paths, write_example_dataset, write_tiny_wan


def with_input_image(meta):
    lines = meta.read_text().splitlines()
    meta.write_text("\n".join([lines[0] + ",input_image"] + [f"{ln},{ln.split(',')[0]}" for ln in lines[1:]]) + "\n")
    return meta


def flags(paths, *more):
    return ["--family", "wan", "--model_paths", json.dumps(paths), "--torch_dtype", "float32", "--learning_rate",
            1e-3, "--dataset_repeat", 2, "--num_epochs", 1, "--seed", 5, "--no_progress", "--enable_tensorboard_log",
            "false", "--lora_base_model", "dit", "--lora_target_modules", "q,k,v,o,ffn.0,ffn.2", "--lora_rank", 4,
            "--extra_inputs", "input_image", "--enable_csv_log", *more]


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    base = tmp_path_factory.mktemp("experts")
    paths = tiny_wan_paths(write_tiny_wan(base / "i2v_a14b", "i2v_a14b"))
    meta = with_input_image(write_example_dataset(base / "data", n=2, size=(48, 32)))
    return {k: v[0] for k, v in paths.items()}, meta


@pytest.mark.parametrize("task", ["sft", "sft:split"])
def test_both_experts_equal_the_reference_two_runs(pair, tmp_path, task):
    """The reference's Wan2.2-I2V-A14B.sh: high noise on transformer/ with --max_timestep_boundary 0.358
    --min_timestep_boundary 0, low noise on transformer_2/ with 1 / 0.358 — against one command."""
    paths, meta = pair
    data = ["--dataset_base_path", meta.parent, "--dataset_metadata_path", meta]
    rest = [paths["text_encoder"], paths["vae"]]
    run_train("--task", "sft", *data, "--output_path", tmp_path / "high",
              *flags([paths["transformer"], *rest], "--max_timestep_boundary", 0.358, "--min_timestep_boundary", 0))
    run_train("--task", "sft", *data, "--output_path", tmp_path / "low",
              *flags([paths["transformer_2"], *rest], "--max_timestep_boundary", 1, "--min_timestep_boundary", 0.358))
    import difftune.models as models_pkg

    real, built = models_pkg.load_component, []
    models_pkg.load_component = lambda *a, **k: built.append(real(*a, **k)) or built[-1]
    try:
        summary = run_train("--task", task, *data, "--output_path", tmp_path / "both",
                            *flags([paths["transformer"], paths["transformer_2"], *rest], "--train_experts", "both",
                                   "--expert_boundary", 0.358))
    finally:
        models_pkg.load_component = real
    # stage 1 once (UMT5 and the VAE loaded once, both clips cached once); then one DiT per expert
    assert sorted(c.name for c in built) == ["dit", "dit", "text_encoder", "vae"]
    assert summary["stage1"]["written"] == 2 and summary["stage1"]["cache"] == str(tmp_path / "both" / "cache")
    for folder, ref in (("high_noise", "high"), ("low_noise", "low")):
        want = load_file(str(tmp_path / ref / "epoch-0.safetensors"))
        got = load_file(str(tmp_path / "both" / folder / "epoch-0.safetensors"))
        assert got.keys() == want.keys() and want
        diff = max((got[k] - want[k]).abs().max().item() for k in want)
        print(f"--train_experts both ({task}), {folder}: max difference to the reference-style run {diff:.2e}")
        assert diff <= 1e-5
        assert (tmp_path / "both" / folder / "loss.csv").read_text() == (tmp_path / ref / "loss.csv").read_text()
    high = load_file(str(tmp_path / "both" / "high_noise" / "epoch-0.safetensors"))
    low = load_file(str(tmp_path / "both" / "low_noise" / "epoch-0.safetensors"))
    assert max((high[k] - low[k]).abs().max().item() for k in high) > 1e-6  # two different LoRAs


def test_both_experts_from_an_existing_cache(pair, tmp_path):
    """*:train --train_experts both reads one stage-1 cache for both experts; without --expert_boundary, the
    I2V-A14B pair takes the reference's 0.358."""
    paths, meta = pair
    rest = [paths["text_encoder"], paths["vae"]]
    run_train("--task", "sft:data_process", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
              "--output_path", tmp_path / "cache", *flags(rest))
    both = [paths["transformer"], paths["transformer_2"]]
    run_train("--task", "sft:train", "--dataset_base_path", tmp_path / "cache", "--output_path", tmp_path / "two",
              *flags(both, "--train_experts", "both"))
    run_train("--task", "sft:train", "--dataset_base_path", tmp_path / "cache", "--output_path", tmp_path / "low",
              *flags([paths["transformer_2"]], "--max_timestep_boundary", 1, "--min_timestep_boundary", 0.358))
    want = load_file(str(tmp_path / "low" / "epoch-0.safetensors"))
    got = load_file(str(tmp_path / "two" / "low_noise" / "epoch-0.safetensors"))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert (tmp_path / "two" / "high_noise" / "epoch-0.safetensors").is_file()


def test_expert_boundary_default_is_the_reference_one(pair, tmp_path):
    from difftune.families.wan.dit_keys import expert_boundary
    from difftune.models import ModelConfig

    paths, _ = pair
    t2v = tiny_wan_paths(write_tiny_wan(tmp_path / "a14b", "a14b"))
    assert expert_boundary([("dit", ModelConfig(paths["transformer"]))]) == 0.358  # Wan2.2-I2V-A14B.sh
    assert expert_boundary([("dit", ModelConfig(t2v["transformer"][0]))]) == 0.417  # Wan2.2-T2V-A14B.sh
    ti2v = tiny_wan_paths(write_tiny_wan(tmp_path / "ti2v", "ti2v"))
    assert expert_boundary([("dit", ModelConfig(ti2v["transformer"][0]))]) is None  # not an expert


@pytest.mark.parametrize("which, more, message", [
    ("one", ["--train_experts", "both", "--expert_boundary", 0.358], "name both experts' weights"),
    ("both", ["--train_experts", "both", "--expert_boundary", 1.0], "in \\(0, 1\\)"),
    ("both", ["--train_experts", "both", "--expert_boundary", 0.358, "--max_timestep_boundary", 0.5],
     "not with --train_experts both"),
    ("both", ["--expert_boundary", 0.358], "only with --train_experts both"),
    ("both", ["--train_experts", "both", "--timestep_sampling", "logit_normal"], "uniform only"),
])
def test_train_experts_refusals(pair, tmp_path, which, more, message):
    paths, meta = pair
    dits = [paths["transformer"]] + ([paths["transformer_2"]] if which == "both" else [])
    with pytest.raises(UserError, match=message):
        run_train("--task", "sft", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
                  "--output_path", tmp_path / "x", *flags([*dits, paths["text_encoder"], paths["vae"]], *more))
    assert not list(tmp_path.glob("x/**/*.safetensors"))
