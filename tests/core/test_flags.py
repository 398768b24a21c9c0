"""Flags that only log, and reference flags difftune refuses: nothing accepted is silently ignored."""

import csv
import math
import re

import pytest

from conftest import make_image_dataset, model_paths_json, run_train
from difftune.cli.args import REFUSED


def cli(*argv):
    from difftune.cli.main import main

    return main([str(a) for a in argv])


def base(meta, out, repo, *extra):
    return ["--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--max_pixels", 4096,
            "--model_paths", model_paths_json(repo), "--output_path", out, "--lora_base_model", "dit",
            "--lora_target_modules", "to_q", "--lora_rank", 2, "--torch_dtype", "float32", "--no_progress",
            "--learning_rate", "1e-3", *extra]


def read_csv(path):
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def test_csv_log_has_one_row_per_optimizer_step(tmp_path, tiny_repo):
    meta = make_image_dataset(tmp_path / "data", n=2)
    out = tmp_path / "out"
    summary = run_train(*base(meta, out, tiny_repo, "--enable_csv_log", "--dataset_repeat", 3, "--num_epochs", 2,
                              "--gradient_accumulation_steps", 2, "--lr_scheduler", "linear", "--max_steps", 5))
    rows = read_csv(out / "loss.csv")
    assert list(rows[0]) == ["step", "epoch", "loss", "lr"]
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4, 5]
    assert [int(r["epoch"]) for r in rows] == [0, 0, 0, 1, 1]  # 3 optimizer steps per epoch (6 samples / 2)
    assert [float(r["loss"]) for r in rows] == pytest.approx(summary["losses"], rel=1e-6)
    lrs = [float(r["lr"]) for r in rows]  # linear decay over the 5 steps, the rate each step used
    assert lrs == pytest.approx([1e-3 * (1 - i / 5) for i in range(5)], rel=1e-6)
    assert all(math.isfinite(float(r["loss"])) for r in rows)


def test_csv_log_on_resume_keeps_rows_up_to_the_resumed_step(tmp_path, tiny_repo):
    meta = make_image_dataset(tmp_path / "data", n=2)
    out = tmp_path / "out"
    args = base(meta, out, tiny_repo, "--enable_csv_log", "--dataset_repeat", 4, "--save_state_steps", 2)
    run_train(*args, "--max_steps", 3)
    assert [int(r["step"]) for r in read_csv(out / "loss.csv")] == [1, 2, 3]
    run_train(*args, "--resume_from_checkpoint", "latest", "--max_steps", 4)  # from step 2: step 3 again
    rows = read_csv(out / "loss.csv")
    assert [int(r["step"]) for r in rows] == [1, 2, 3, 4]


def test_no_csv_without_the_flag(tmp_path, tiny_repo):
    meta = make_image_dataset(tmp_path / "data", n=2)
    run_train(*base(meta, tmp_path / "out", tiny_repo, "--max_steps", 1))
    assert not (tmp_path / "out" / "loss.csv").exists()


# (--enable_wandb_log / --enable_swanlab_log are implemented now: tests/training/test_trackers.py)
@pytest.mark.parametrize("flag,value", [("--framewise_decoding", None), ("--num_frames", "49")])
def test_unimplemented_reference_flag_is_refused_in_one_line(tmp_path, tiny_repo, capsys, flag, value):
    meta = make_image_dataset(tmp_path / "data", n=2)
    out = tmp_path / "out"
    code = cli("train", *base(meta, out, tiny_repo), flag, *([value] if value is not None else []))
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert err[0].startswith(f"error: {flag}: ") and "not" in err[0], err[0]
    assert not any(out.glob("*.safetensors"))  # refused before any work


def test_every_refused_flag_is_parsed_and_refused(tmp_path):
    from difftune.cli.args import check_training_args, training_parser
    from difftune.errors import UserError

    for name, (kind, _) in REFUSED.items():
        args = training_parser().parse_args(["--dataset_base_path", str(tmp_path), f"--{name}",
                                             *([] if kind == "switch" else ["x"])])
        with pytest.raises(UserError, match=f"^--{name}: not supported"):
            check_training_args(args)


def test_offload_models_is_accepted_with_a_note(tmp_path, tiny_repo, capsys):
    meta = make_image_dataset(tmp_path / "data", n=2)
    out = tmp_path / "out"
    assert cli("train", *base(meta, out, tiny_repo, "--max_steps", 1), "--offload_models", "dit") == 0
    assert "--offload_models dit is not needed" in capsys.readouterr().out
    assert (out / "epoch-0.safetensors").exists()


@pytest.mark.parametrize("flag,value", [("--extra_inputs", "style_image"), ("--data_file_keys", "image,mask")])
def test_a_column_the_family_never_reads_is_refused_not_dropped(tmp_path, tiny_repo, capsys, flag, value):
    meta = make_image_dataset(tmp_path / "data", n=2)
    lines = meta.read_text().splitlines()  # a column of that name is there: it would be loaded, then dropped
    meta.write_text("\n".join([lines[0] + ",style_image,mask"] + [f"{l},image_1.png,image_1.png" for l in lines[1:]]))
    out = tmp_path / "out"
    code = cli("train", *base(meta, out, tiny_repo), flag, value)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    name = value.split(",")[-1]
    assert err[0].startswith(f"error: {flag} {name}: the qwen_image family does not use an input called"), err[0]
    assert not any(out.glob("*.safetensors"))


def test_cfg_scale_is_noted_for_direct_distill_and_refused_for_sft(capsys):
    """The reference's distillation data names cfg_scale, which its loss never reads: noted there, refused
    elsewhere as any unread column."""
    from difftune.core.family import get_family
    from difftune.errors import UserError
    from difftune.training.builders import check_data_columns
    from difftune.training.config import RunConfig

    pipeline = get_family("qwen_image").pipeline
    config = RunConfig(dataset_base_path=".", extra_inputs="seed,cfg_scale", task="direct_distill")
    check_data_columns(config, pipeline, "qwen_image")
    assert "note: --extra_inputs cfg_scale: direct_distill trains the student at cfg 1" in capsys.readouterr().out
    with pytest.raises(UserError, match="--extra_inputs cfg_scale: the qwen_image family does not use"):
        check_data_columns(config.replace(task="sft"), pipeline, "qwen_image")


@pytest.mark.parametrize("alpha, rank, refused", [("1e30", "4", True), ("40001", "4", True), ("40000", "4", False),
                                                  ("64", "32", False)])
def test_an_absurd_lora_alpha_is_refused_as_in_a_file(tmp_path, alpha, rank, refused):
    """--lora_alpha 1e30 was accepted and ended as a 'non-finite loss' steps later; a file's alpha above 1e4 x its
    rank is refused (lora/formats.py), and so is the flag's."""
    from difftune.cli.args import check_training_args, training_parser
    from difftune.errors import UserError

    args = training_parser().parse_args(["--dataset_base_path", str(tmp_path), "--lora_alpha", alpha,
                                         "--lora_rank", rank])
    if refused:
        with pytest.raises(UserError, match=rf"^--lora_alpha {re.escape(f'{float(alpha):g}')}: at --lora_rank {rank} a "
                                                 rf"scale of"):
            check_training_args(args)
    else:
        check_training_args(args)
