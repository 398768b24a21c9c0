"""Bad input: each case is one clear line (exit code 2, no traceback), and nothing already written is lost."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import LORA_TARGETS, make_image_dataset, model_paths_json, run_train


def cli(*argv):
    from difftune.cli.main import main

    return main([str(a) for a in argv])


@pytest.fixture()
def trained(tmp_path, tiny_repo):
    """A data set and an output directory that already holds a checkpoint from an earlier run."""
    meta = make_image_dataset(tmp_path / "data", n=2)
    out = tmp_path / "out"
    run_train("--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--max_pixels", 4096,
              "--model_paths", model_paths_json(tiny_repo), "--output_path", out, "--lora_base_model", "dit",
              "--lora_target_modules", "to_q", "--lora_rank", 2, "--torch_dtype", "float32", "--no_progress")
    before = {p.name: p.read_bytes() for p in out.iterdir() if p.is_file()}
    return meta, out, before


def base_args(meta, out, repo):
    return ["train", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--max_pixels", 4096,
            "--model_paths", model_paths_json(repo), "--output_path", out, "--lora_base_model", "dit",
            "--lora_target_modules", "to_q", "--lora_rank", 2, "--torch_dtype", "float32", "--no_progress"]


def stage1_cache(meta, cache, repo, capsys):
    assert cli(*base_args(meta, cache, repo), "--task", "sft:data_process") == 0
    capsys.readouterr()
    return cache


def stage2_args(cache, out, repo):
    return ["train", "--task", "sft:train", "--dataset_base_path", cache, "--model_paths", model_paths_json(repo),
            "--output_path", out, "--lora_base_model", "dit", "--lora_target_modules", "to_q", "--torch_dtype",
            "float32", "--no_progress"]


def one_line_error(capsys, code, *expected):
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2, err
    assert len(err) == 1 and err[0].startswith("error: "), err
    for e in expected:
        assert e in err[0], (e, err[0])
    return err[0]


def still_there(out, before):
    for name, data in before.items():
        assert (out / name).read_bytes() == data, name


def replace_arg(args, flag, value):
    args = list(args)
    args[args.index(flag) + 1] = value
    return args


DATA_CASES = {
    "zero-byte file": (lambda d: (d / "image_1.png").write_bytes(b""), ["row 1", "0 bytes", "image_1.png"]),
    "non-image file": (lambda d: (d / "image_2.png").write_text("hello"), ["row 2", "not an image", "image_2.png"]),
    "truncated image": (lambda d: (d / "image_1.png").write_bytes((d / "image_1.png").read_bytes()[:60]),
                        ["row 1", "image_1.png"]),
    "missing file": (lambda d: (d / "image_2.png").unlink(), ["row 2", "file not found", "image_2.png"]),
    "wrong columns": (lambda d: (d / "metadata.csv").write_text("file,caption\nimage_1.png,a\n"), ["image", "column"]),
    "empty metadata": (lambda d: (d / "metadata.csv").write_text(""), ["metadata.csv", "empty"]),
}


@pytest.mark.parametrize("case", sorted(DATA_CASES))
def test_bad_data(trained, tiny_repo, capsys, case):
    meta, out, before = trained
    breaker, expected = DATA_CASES[case]
    breaker(meta.parent)
    one_line_error(capsys, cli(*base_args(meta, out, tiny_repo)), *expected)
    still_there(out, before)


def test_bad_model_paths_json(trained, tiny_repo, capsys):
    meta, out, before = trained
    args = replace_arg(base_args(meta, out, tiny_repo), "--model_paths", '["a.safetensors",]')
    one_line_error(capsys, cli(*args), "--model_paths")
    still_there(out, before)


def test_missing_model_file(trained, tiny_repo, capsys, tmp_path):
    meta, out, before = trained
    args = replace_arg(base_args(meta, out, tiny_repo), "--model_paths", json.dumps([str(tmp_path / "nope.safetensors")]))
    one_line_error(capsys, cli(*args), "nope.safetensors")
    still_there(out, before)


def test_wrong_model_file(trained, tiny_repo, capsys, tmp_path):
    meta, out, before = trained
    fake = tmp_path / "weights.safetensors"
    fake.write_text("not a safetensors file")
    args = replace_arg(base_args(meta, out, tiny_repo), "--model_paths", json.dumps([str(fake)]))
    one_line_error(capsys, cli(*args), "weights.safetensors")


def test_pickled_model_file_is_refused(trained, tiny_repo, capsys, tmp_path):
    meta, out, before = trained
    pickled = tmp_path / "model.bin"
    torch.save({"w": torch.zeros(1)}, pickled)
    args = replace_arg(base_args(meta, out, tiny_repo), "--model_paths", json.dumps([str(pickled)]))
    one_line_error(capsys, cli(*args), "model.bin")


def test_lora_checkpoint_for_another_model(trained, tiny_repo, capsys, tmp_path):
    meta, out, before = trained
    other = tmp_path / "other_lora.safetensors"
    save_file({"transformer.down_blocks.0.conv.lora_A.weight": torch.zeros(2, 8),
               "transformer.down_blocks.0.conv.lora_B.weight": torch.zeros(8, 2)}, str(other))
    one_line_error(capsys, cli(*base_args(meta, out, tiny_repo), "--lora_checkpoint", other), "other_lora.safetensors")
    still_there(out, before)


def test_unwritable_output_path(trained, tiny_repo, capsys, tmp_path):
    meta, out, before = trained
    blocker = tmp_path / "a_file"
    blocker.write_text("x")
    args = replace_arg(base_args(meta, out, tiny_repo), "--output_path", blocker / "sub")
    one_line_error(capsys, cli(*args), "--output_path", "cannot write")


def test_cache_from_another_family(trained, tiny_repo, capsys, tmp_path):
    meta, out, before = trained
    cache = stage1_cache(meta, tmp_path / "cache", tiny_repo, capsys)
    manifest = json.loads((cache / "manifest.json").read_text())
    manifest["family"] = "flux"
    (cache / "manifest.json").write_text(json.dumps(manifest))
    one_line_error(capsys, cli(*stage2_args(cache, out, tiny_repo)), "flux")
    still_there(out, before)


def test_pickle_inside_a_cache_is_refused(trained, tiny_repo, capsys, tmp_path):
    meta, out, before = trained
    cache = stage1_cache(meta, tmp_path / "cache", tiny_repo, capsys)
    torch.save({"x": 1}, cache / "part-00000" / "evil.pth")
    one_line_error(capsys, cli(*stage2_args(cache, out, tiny_repo)), "evil.pth")


def test_pickle_inside_a_training_state_is_refused(tmp_path, tiny_repo, capsys):
    meta = make_image_dataset(tmp_path / "data", n=2)
    args = base_args(meta, tmp_path / "out", tiny_repo) + ["--save_state_steps", 1, "--max_steps", 1]
    assert cli(*args) == 0
    capsys.readouterr()
    state = next((tmp_path / "out" / "state").glob("step-*"))
    torch.save({"x": 1}, state / "optimizer.pt")
    one_line_error(capsys, cli(*args, "--resume_from_checkpoint", "latest"), "optimizer.pt")


def test_non_finite_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, tiny_repo, capsys):
    meta = make_image_dataset(tmp_path / "data", n=2)
    args = base_args(meta, tmp_path / "out", tiny_repo) + ["--save_steps", 1, "--dataset_repeat", 20,
                                                            "--learning_rate", 1e30]
    line = one_line_error(capsys, cli(*args), "non-finite loss at step", "sample(s)", "last good checkpoint")
    saved = sorted((tmp_path / "out").glob("step-*.safetensors"))
    assert saved and str(saved[-1]) in line
    last = load_file(str(saved[-1]))
    assert all(torch.isfinite(v).all() for v in last.values())


def test_skip_bad_samples_and_report_them(tmp_path, tiny_repo):
    meta = make_image_dataset(tmp_path / "data", n=3)
    (meta.parent / "image_2.png").write_bytes(b"garbage")
    summary = run_train("--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--max_pixels", 4096,
                        "--model_paths", model_paths_json(tiny_repo), "--output_path", tmp_path / "out",
                        "--lora_base_model", "dit", "--lora_target_modules", "to_q", "--lora_rank", 2,
                        "--torch_dtype", "float32", "--no_progress", "--on_bad_sample", "skip", "--dataset_repeat", 2)
    report = json.loads((tmp_path / "out" / "bad_samples.json").read_text())
    assert len(report["skipped"]) == 1 and report["skipped"][0]["id"].startswith("000001-")
    assert "image_2.png" in json.dumps(report)
    assert summary["steps"] == 4 and (tmp_path / "out" / "epoch-0.safetensors").exists()


@pytest.mark.parametrize("flag,value", [
    ("--max_steps", 0), ("--max_steps", -3), ("--num_epochs", 0), ("--dataset_repeat", 0), ("--lora_rank", 0),
    ("--learning_rate", 0), ("--learning_rate", -1e-4), ("--learning_rate", "nan"), ("--gradient_accumulation_steps", 0),
    ("--batch_size", 0), ("--save_steps", 0), ("--save_state_steps", 0), ("--lora_alpha", 0),
    ("--validation_steps", 0), ("--dataset_num_workers", -1), ("--weight_decay", -0.1), ("--max_grad_norm", -1)])
def test_nonsense_numbers_are_refused_before_anything_runs(tmp_path, tiny_repo, capsys, flag, value):
    # before: --max_steps 0 exited 0 having trained nothing; --save_steps 0 failed with a traceback
    meta = make_image_dataset(tmp_path / "data", n=2)
    out = tmp_path / "out"
    line = one_line_error(capsys, cli(*base_args(meta, out, tiny_repo), flag, value), f"{flag} {value}", "must be")
    assert "\n" not in line
    assert not out.exists()  # refused before the output folder is touched
