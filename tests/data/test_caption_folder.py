"""kohya's data layout as a data set: a folder of images with their caption files, `<repeats>_<class tokens>/`
subfolders; it trains, and a caption edited after stage 1 asks for a new cache."""

from __future__ import annotations

import json

import pytest
from PIL import Image

from difftune.data import DataError
from difftune.data.dataset import read_caption_folder


def _picture(path, color):
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (32, 32), color).save(path)


@pytest.fixture
def folder(tmp_path):
    root = tmp_path / "train"
    _picture(root / "a.png", "red")
    (root / "a.txt").write_text("a red square\n", encoding="utf-8")
    _picture(root / "3_sks dog" / "b.jpg", "blue")
    (root / "3_sks dog" / "b.caption").write_text("sks dog, blue", encoding="utf-8")
    _picture(root / "3_sks dog" / "c.webp", "green")  # no caption: the folder's class tokens
    (root / "3_sks dog" / "notes.md").write_text("not an image")
    return root


def test_rows_follow_kohyas_layout(folder):
    rows = read_caption_folder(folder)
    assert [(r["image"].rsplit("/", 1)[-1], r["prompt"]) for r in rows] == (
        [("a.png", "a red square")] + [("b.jpg", "sks dog, blue")] * 3 + [("c.webp", "sks dog")] * 3)
    assert all(r["image"].startswith(str(folder)) for r in rows)


def test_bad_folders_are_refused_in_one_line(folder, tmp_path):
    _picture(folder / "extra" / "d.png", "white")
    with pytest.raises(DataError, match=r"d.png: no caption file beside it \(d.txt or .caption\)"):
        read_caption_folder(folder)
    (tmp_path / "empty").mkdir()
    with pytest.raises(DataError, match="no images"):
        read_caption_folder(tmp_path / "empty")
    (tmp_path / "meta").mkdir()
    (tmp_path / "meta" / "metadata.csv").write_text("image,prompt\n")
    with pytest.raises(DataError, match="a folder holding metadata.csv: name that file"):
        read_caption_folder(tmp_path / "meta")
    _picture(tmp_path / "zero" / "0_x" / "e.png", "black")
    with pytest.raises(DataError, match="0 repeats"):
        read_caption_folder(tmp_path / "zero")


def test_a_caption_folder_trains_and_an_edited_caption_needs_a_new_cache(folder, tmp_path):
    from conftest import run_train
    from difftune.errors import UserError
    from support.stable_diffusion import sd_model_paths, write_tiny_sd_hub

    hub = write_tiny_sd_hub(tmp_path / "hub")
    common = ("--dataset_base_path", folder, "--dataset_metadata_path", folder, "--height", 32, "--width", 32,
              "--model_paths", json.dumps(sd_model_paths(hub)), "--lora_base_model", "unet",
              "--lora_target_modules", "to_k", "--lora_rank", 2, "--no_progress")
    run_train(*common, "--max_steps", 2, "--output_path", tmp_path / "out")
    assert sorted((tmp_path / "out").glob("*.safetensors"))
    run_train(*common, "--task", "sft:data_process", "--output_path", tmp_path / "cache")
    (folder / "a.txt").write_text("a crimson square", encoding="utf-8")
    with pytest.raises(UserError, match="rebuild_cache|other settings|changed"):
        run_train(*common, "--task", "sft:data_process", "--output_path", tmp_path / "cache")
