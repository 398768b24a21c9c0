"""Model and optimizer offload in `difftune train` runs of the tiny Qwen-Image (fp32, target device: the CPU): the
same LoRA as the run without them, bit for bit, in one-stage and split (stage 2) training."""

import pytest
import torch
from safetensors.torch import load_file

from conftest import LORA_TARGETS, make_image_dataset, model_paths_json, run_train
from difftune.errors import UserError


def common(tmp_path, tiny_repo, *extra):
    meta = make_image_dataset(tmp_path / "data", n=2, size=(32, 32))
    return ["--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--max_pixels", 1024,
            "--model_paths", model_paths_json(tiny_repo), "--torch_dtype", "float32", "--seed", 5,
            "--learning_rate", 1e-3, "--dataset_repeat", 2, "--lora_base_model", "dit",
            "--lora_target_modules", LORA_TARGETS, "--lora_rank", 4, "--no_progress",
            "--use_gradient_checkpointing", *extra]


# Offload computes with the same weights, in fresh (64-byte aligned) tensors; the plain run's weights are the
# safetensors file's memory map, at the file's offsets. Some CPUs' kernels round differently at other alignments
# (AMD EPYC: up to 5.4e-7 on these LoRAs), so the runs agree within this, and a 1% change of the learning rate
# moves them far more (test_the_tolerance_sees_a_one_percent_learning_rate_change).
TOLERANCE = 2e-6


def max_difference(a, b) -> float:
    x, y = load_file(str(a)), load_file(str(b))
    assert x.keys() == y.keys() and any(".lora_B." in k for k in x)
    assert max(v.abs().max().item() for k, v in x.items() if ".lora_B." in k) > 0  # it trained
    return max((x[k] - y[k]).abs().max().item() for k in x)


def same_files(a, b):
    difference = max_difference(a, b)
    assert difference <= TOLERANCE, difference


@pytest.mark.parametrize("task", ["sft", "sft:split"])
def test_offloaded_runs_train_the_same_lora(tmp_path, tiny_repo, capsys, task):
    args = common(tmp_path, tiny_repo, "--task", task, "--gradient_accumulation_steps", 2)
    run_train(*args, "--output_path", tmp_path / "plain")
    capsys.readouterr()
    run_train(*args, "--output_path", tmp_path / "off", "--enable_model_cpu_offload",
              "--enable_optimizer_cpu_offload")
    log = capsys.readouterr().out
    assert "model offload: dit: 2 of 2 blocks (transformer_blocks)" in log and "resident on cpu" in log
    assert "optimizer offload:" in log
    same_files(tmp_path / "plain" / "epoch-0.safetensors", tmp_path / "off" / "epoch-0.safetensors")


def test_the_tolerance_sees_a_one_percent_learning_rate_change(tmp_path, tiny_repo):
    args = common(tmp_path, tiny_repo)
    run_train(*args, "--output_path", tmp_path / "plain")
    run_train(*args, "--output_path", tmp_path / "lr", "--learning_rate", 1.01e-3)
    assert max_difference(tmp_path / "plain" / "epoch-0.safetensors", tmp_path / "lr" / "epoch-0.safetensors") > \
        20 * TOLERANCE


def test_partial_swap_and_split_threshold_train_the_same_lora(tmp_path, tiny_repo, capsys):
    args = common(tmp_path, tiny_repo)
    run_train(*args, "--output_path", tmp_path / "plain")
    capsys.readouterr()
    run_train(*args, "--output_path", tmp_path / "off", "--blocks_to_swap", 1, "--cpu_offload_split_threshold",
              0.001)
    log = capsys.readouterr().out
    assert "model offload: dit: 1 of 2 blocks (transformer_blocks)" in log
    same_files(tmp_path / "plain" / "epoch-0.safetensors", tmp_path / "off" / "epoch-0.safetensors")


def test_offload_flags_are_checked(tmp_path, tiny_repo):
    args = common(tmp_path, tiny_repo, "--output_path", tmp_path / "o")
    with pytest.raises(UserError, match="--blocks_to_swap 7: .* has 2 blocks"):
        run_train(*args, "--blocks_to_swap", 7)
    with pytest.raises(UserError, match="--blocks_to_swap -1: must be 0 or more"):
        from difftune.cli.args import check_training_args
        from conftest import train_args

        check_training_args(train_args(*args, "--blocks_to_swap", -1))


# Two DDP processes under model and optimizer offload: tests/training/test_distributed.py's stage-2 launch.


@pytest.mark.slow
def test_optimizer_offload_resumes_exactly(tmp_path, tiny_repo, capsys):
    from test_resume import kill_after_state, run_in_process, train_cmd

    meta = make_image_dataset(tmp_path / "data", n=2)
    models = model_paths_json(tiny_repo)
    extra = ["--enable_optimizer_cpu_offload", "--enable_model_cpu_offload"]
    run_in_process(train_cmd(meta.parent, meta, models, tmp_path / "full", *extra))
    killed_at = kill_after_state(train_cmd(meta.parent, meta, models, tmp_path / "killed", *extra),
                                 tmp_path / "killed" / "state", min_step=4)
    assert killed_at < 12
    capsys.readouterr()
    run_in_process(train_cmd(meta.parent, meta, models, tmp_path / "killed", *extra, "--resume_from_checkpoint",
                             "latest"))
    out = capsys.readouterr().out
    assert "resumed from" in out and "optimizer offload:" in out
    a = load_file(str(tmp_path / "full" / "epoch-1.safetensors"))
    b = load_file(str(tmp_path / "killed" / "epoch-1.safetensors"))
    assert max((a[k] - b[k]).abs().max().item() for k in a) <= 1e-6


@pytest.mark.parametrize("family", ["flux", "wan", "krea2"])
def test_other_families_offload_without_declaring_anything(tmp_path, capsys, family):
    """The blocks are found generically: FLUX's double- and single-stream lists, Wan's blocks, Krea-2's text fusion
    and transformer blocks (its text fusion, which diffusers does not checkpoint, was refused as 'run without
    gradient checkpointing'); the LoRA trained with every block offloaded equals the resident run's."""
    import json

    from support import tiny_flux_paths, tiny_wan_paths, write_example_dataset, write_tiny_flux, write_tiny_wan

    if family == "flux":
        from difftune.families.flux.components import LORA_TARGET_MODULES as targets

        paths = [p if len(p) > 1 else p[0] for p in tiny_flux_paths(write_tiny_flux(tmp_path / "repo")).values()]
        shown = "(transformer_blocks, single_transformer_blocks)"
    elif family == "wan":
        targets = "q,k,v,o,ffn.0,ffn.2"
        paths = [p[0] for p in tiny_wan_paths(write_tiny_wan(tmp_path / "repo", "t2v")).values()]
        shown = "(blocks)"
    else:
        from support.krea2.tiny import krea2_model_paths, write_tiny_krea2_hub

        write_tiny_krea2_hub(tmp_path / "repo")
        paths, targets = krea2_model_paths(tmp_path / "repo"), "to_q,to_k,to_v"
        shown = "(text_fusion.layerwise_blocks, text_fusion.refiner_blocks, transformer_blocks)"
    meta = write_example_dataset(tmp_path / "data", n=2, size=(48, 32))
    args = ["--task", "sft", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--model_paths",
            json.dumps(paths), "--torch_dtype", "float32", "--learning_rate", 1e-3, "--dataset_repeat", 2,
            "--seed", 5, "--no_progress", "--enable_tensorboard_log", "false", "--max_pixels", 4096,
            "--lora_base_model", "dit", "--lora_target_modules", targets, "--lora_rank", 4,
            "--use_gradient_checkpointing"]
    run_train(*args, "--output_path", tmp_path / "plain")
    capsys.readouterr()
    run_train(*args, "--output_path", tmp_path / "off", "--enable_model_cpu_offload")
    line = next(ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("model offload:"))
    assert f"blocks {shown}" in line, line
    same_files(tmp_path / "plain" / "epoch-0.safetensors", tmp_path / "off" / "epoch-0.safetensors")
