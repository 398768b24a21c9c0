"""Issue 25, items 1-7: nothing trains on the wrong data without a word, in every family where the input applies: a
cache missing shards, stage-2 size flags against the cache, a row without a prompt, a size off the size factor, full
and LoRA training of one model, a frame past the positional table, animated WebP. One tiny workspace per family (its
models, a two-row data set and one stage-1 cache, one shard per sample); most cases stop at start-up, before a model
is loaded. The cases that need no workspace are beside their code: EliGen rows (item 8) in the Qwen-Image control
tests (tests/families/qwen_image/test_qwen_control.py), empty prompts read as "" (item 3) and the `--max_pixels`
wording (item 9) in tests/data/test_dataset.py."""

from __future__ import annotations

import json
import shutil

import pytest
from PIL import Image

from conftest import setup_run
from difftune.core.family import families
from support import tiny_family, write_example_dataset

FAMILIES = sorted(n for n in families() if n in ("qwen_image", "flux", "wan"))


def cli(*argv):
    from difftune.cli.main import main

    return main(["train", *[str(a) for a in argv]])


def one_line(capsys, code, *expected):
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith("error: "), err
    for e in expected:
        assert e in err[0], (e, err[0])
    return err[0]


@pytest.fixture(scope="module", params=FAMILIES)
def ws(request, tmp_path_factory):
    """A family's tiny models, a two-row data set and its stage-1 cache (written one sample per shard)."""
    folder = tmp_path_factory.mktemp(f"wrong_data_{request.param}")
    t = tiny_family(request.param, folder)
    t.name = request.param
    t.metadata = t.write_dataset(folder / "data")
    t.video = families()[t.name].target.frames is not None
    t.cache = folder / "cache"
    assert cli("--task", "sft:data_process", "--dataset_base_path", t.metadata.parent, "--dataset_metadata_path",
               t.metadata, "--output_path", t.cache, "--cache_commit_every", 1, *common(t)) == 0
    return t


def common(t, *more):
    return ["--family", t.name, "--model_paths", json.dumps(t.model_paths), "--torch_dtype", "float32", "--seed", 5,
            "--no_progress", "--enable_tensorboard_log", "false", *t.flags, "--lora_base_model", t.lora_base_model,
            "--lora_target_modules", t.lora_target_modules, "--lora_rank", 2, *more]


def stage2(t, cache, out, *more):
    return cli("--task", "sft:train", "--dataset_base_path", cache, "--output_path", out, "--max_steps", 1,
               *common(t, *more))


# -- 1. a cache that lost committed shards ----------------------------------------------------------------------

def test_stage2_refuses_a_cache_missing_committed_shards(ws, tmp_path, capsys):
    from difftune.cache import verify_cache

    partial = tmp_path / "partial"
    shutil.copytree(ws.cache, partial)
    shards = sorted((partial / "part-00000").glob("shard-*.json"))
    assert len(shards) == 2  # one per sample
    shards[0].unlink()
    shards[0].with_suffix(".safetensors").unlink()  # what a copy that stopped half way leaves
    report = verify_cache(partial)
    assert any("committed 2 samples, 1 found" in p for p in report.problems), report.problems
    capsys.readouterr()
    code = stage2(ws, partial, tmp_path / "out")
    one_line(capsys, code, str(partial), "missing committed shards", "committed 2 samples, 1 found",
             "difftune cache verify")
    assert not (tmp_path / "out" / "epoch-0.safetensors").exists()
    # a tensor file alone gone (its index kept) is refused at start-up too, not at the first read
    again = tmp_path / "tensors"
    shutil.copytree(ws.cache, again)
    next((again / "part-00000").glob("shard-*.safetensors")).unlink()
    one_line(capsys, stage2(ws, again, tmp_path / "out2"), "tensor file", "is missing")


# -- 2. stage-2 size flags that contradict the cache ------------------------------------------------------------

@pytest.mark.parametrize("flags,named", [(("--height", 64, "--width", 96), "--height 64"),
                                         (("--max_pixels", 1024), "--max_pixels 1024"),
                                         (("--num_frames", 9), "--num_frames 9")])
def test_stage2_refuses_size_flags_that_contradict_the_cache(ws, tmp_path, capsys, flags, named):
    if "--num_frames" in flags and not ws.video:
        pytest.skip("--num_frames is a video family's flag")
    capsys.readouterr()
    # the cache was made with --max_pixels 4096 and no --height/--width (t.flags); a later flag wins in argparse
    err = one_line(capsys, stage2(ws, ws.cache, tmp_path / "out", *flags), named, str(ws.cache), "stage 2 trains "
                   "on the cached")
    assert ("no --height" in err) if "--height" in flags else True
    assert ("--max_pixels 4096" in err) if "--max_pixels" in flags else True


def test_stage2_takes_the_flags_stage_1_was_given(ws, tmp_path, capsys):
    """The same flags as stage 1 (what the reference's split scripts pass to both stages) are no contradiction."""
    assert stage2(ws, ws.cache, tmp_path / "out", "--max_pixels", 4096) == 0
    assert (tmp_path / "out").glob("*.safetensors")


# -- 3. prompts: an empty cell, NaN, a missing field ------------------------------------------------------------

@pytest.mark.parametrize("case", ["csv_empty_cell", "jsonl_nan", "jsonl_missing", "json_list"])
def test_a_row_without_a_text_prompt_is_refused_naming_the_row(ws, tmp_path, capsys, case):
    meta = write_example_dataset(tmp_path / "data", n=2, size=(48, 32))
    rows = [{"image": "image_1.png", "prompt": "a red circle"}, {"image": "image_2.png"}]
    if case == "csv_empty_cell":
        meta.write_text("image,prompt\nimage_1.png,a red circle\nimage_2.png,\n")
    else:
        value = {"jsonl_nan": "NaN", "jsonl_missing": None, "json_list": '["a", "b"]'}[case]
        lines = [json.dumps(rows[0]), '{"image": "image_2.png"' + (f', "prompt": {value}' if value else "") + "}"]
        meta = tmp_path / "data" / "metadata.jsonl"
        meta.write_text("\n".join(lines) + "\n")
    args = ["--task", "sft", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--output_path",
            tmp_path / "out", "--max_steps", 1, *common(ws)]
    capsys.readouterr()
    one_line(capsys, cli(*args), f"{meta} row 2", "'prompt'", "--allow_empty_prompts")
    assert cli(*args, "--allow_empty_prompts") == 0  # trains that row on the empty prompt
    assert list((tmp_path / "out").glob("*.safetensors"))


# -- 5. a fixed size that is not a multiple of the size factor --------------------------------------------------

def test_a_height_off_the_size_factor_is_rounded_with_one_note_and_cropped_not_stretched(ws, tmp_path):
    meta = write_example_dataset(tmp_path / "data", n=1, size=(64, 64))
    logged = []
    run = setup_run("--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--output_path",
                    tmp_path / "out", "--height", 33, "--width", 48, *common(ws))
    from difftune.training.builders import make_dataset

    factor = run.pipeline.target.primary.division
    run = run.replace(log=logged.append)
    item = make_dataset(run)[0]
    frames = item["image"]  # a video family reads a still as a one-frame clip
    first = frames[0] if isinstance(frames, list) else frames
    want = -(-33 // factor) * factor
    assert first.size == (48, want)
    notes = [m for m in logged if "--height 33 -> " in m]
    assert len(notes) == 1 and f"--height 33 -> {want}" in notes[0] and "not stretched" in notes[0]
    from difftune.data import cover_crop

    source = Image.open(meta.parent / "image_1.png").convert("RGB")
    assert list(first.getdata()) == list(cover_crop(source, 48, want).getdata())  # cropped: no distortion


# -- 6. a model trained fully and through a LoRA at once --------------------------------------------------------

def test_full_and_lora_training_of_one_model_is_refused(ws, tmp_path, capsys):
    capsys.readouterr()
    code = cli("--task", "sft", "--dataset_base_path", ws.metadata.parent, "--dataset_metadata_path", ws.metadata,
               "--output_path", tmp_path / "out", "--max_steps", 1, *common(ws, "--trainable_models",
                                                                             ws.lora_base_model))
    one_line(capsys, code, f"--trainable_models {ws.lora_base_model}", f"--lora_base_model {ws.lora_base_model}",
             "reference trains the LoRA alone")


def test_the_api_refuses_the_pair_too():
    from difftune.errors import UserError
    from difftune.training.module import check_lora_and_full

    with pytest.raises(UserError, match="--trainable_models dit,vae with --lora_base_model dit"):
        check_lora_and_full("dit,vae", "dit")
    check_lora_and_full("vae", "dit")  # another model: fine


# -- 7. a frame wider than the denoiser's positional table ------------------------------------------------------

def test_a_frame_beyond_the_positional_table_is_one_line(ws, tmp_path, capsys):
    from pathlib import Path

    from difftune.core.family import get_family

    spec = get_family(ws.name)
    configs = [Path(p[0] if isinstance(p, list) else p).parent / "config.json" for p in ws.model_paths]
    limit = next((json.loads(c.read_text()).get("rope_max_seq_len") for c in configs if c.is_file()
                  and "rope_max_seq_len" in json.loads(c.read_text())), None)
    if not limit:
        pytest.skip(f"{ws.name}'s denoiser computes its positions (no table to run past)")
    stream = spec.target.primary
    width = (limit + 1) * stream.patch * stream.scale
    root = tmp_path / "data"
    root.mkdir()
    Image.new("RGB", (width, 16), (200, 40, 40)).save(root / "wide.png")
    (root / "metadata.csv").write_text("image,prompt\nwide.png,a wide red band\n")
    capsys.readouterr()
    code = cli("--task", "sft", "--dataset_base_path", root, "--dataset_metadata_path", root / "metadata.csv",
               "--output_path", tmp_path / "out", "--max_steps", 1, *common(ws), "--max_pixels", width * 16)
    one_line(capsys, code, f"{width}x16 px", f"{limit + 1} positions along its width", f"the {limit} of",
             f"at most {limit * stream.patch * stream.scale} px")


# -- 4. animated WebP -------------------------------------------------------------------------------------------

def test_an_animated_webp_is_read_frame_by_frame(ws, tmp_path):
    if not ws.video:
        pytest.skip("an image family reads a file's first frame")
    from difftune.data import UnifiedDataset
    from difftune.media.video import probe_video, write_animation

    colours = [(40 * i, 200 - 30 * i, 90) for i in range(5)]
    frames = [Image.new("RGB", (32, 32), c) for c in colours]
    write_animation(frames, tmp_path / "clip.webp", fps=8)  # what `difftune sample` writes for a clip
    assert probe_video(tmp_path / "clip.webp").frames == 5
    (tmp_path / "metadata.csv").write_text("video,prompt\nclip.webp,a clip\n")
    op = UnifiedDataset.default_video_operator(tmp_path, max_pixels=4096, num_frames=5, time_division_factor=4,
                                               time_division_remainder=1)
    data = UnifiedDataset(tmp_path, tmp_path / "metadata.csv", data_file_keys=("video",), main_data_operator=op)
    clip = data[0]["video"]
    assert len(clip) == 5
    for frame, colour in zip(clip, colours):  # lossy WebP: each frame near its own colour
        assert max(abs(a - b) for a, b in zip(frame.getpixel((16, 16)), colour)) <= 12
    # a still .webp stays a one-frame clip
    frames[0].save(tmp_path / "still.webp")
    assert len(op(str(tmp_path / "still.webp"), {})) == 1
