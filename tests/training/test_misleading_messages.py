"""Messages that named the wrong thing: a missing resume folder reported as 'only .safetensors files are read'; an
edit-image column left out of --data_file_keys refused at stage 1's first batch, naming row 0 (whose files were fine)
instead of the row whose value is no file name."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from difftune.data import DataError, UnifiedDataset
from difftune.errors import UserError


def test_a_missing_resume_folder_is_named_as_missing(tmp_path):
    from difftune.training.builders import find_resume

    for missing in (tmp_path / "out" / "state" / "step-4", tmp_path / "weights.safetensors"):
        config = SimpleNamespace(resume_from_checkpoint=str(missing), output_path=str(tmp_path / "out"))
        with pytest.raises(UserError) as err:
            find_resume(config, pipe=None)
        text = str(err.value)
        assert text.startswith(f"--resume_from_checkpoint {missing}: ") and "does not exist" in text, text
        assert "only .safetensors" not in text


def _edit_rows(tmp_path):
    from PIL import Image

    for name in ("t1.png", "t2.png", "t3.png", "e1.png", "e2.png"):
        Image.new("RGB", (16, 16)).save(tmp_path / name)
    rows = [{"image": "t1.png", "prompt": "a", "edit_image": ["e1.png"]},
            {"image": "t2.png", "prompt": "b", "edit_image": ["e2.png"]},
            {"image": "t3.png", "prompt": "c", "edit_image": ["e3"]}]  # no extension: no file name
    path = tmp_path / "metadata.json"
    path.write_text(json.dumps(rows))
    return path


def test_a_file_column_left_out_of_data_file_keys_names_its_row_up_front(tmp_path):
    metadata = _edit_rows(tmp_path)
    with pytest.raises(DataError) as err:
        UnifiedDataset(str(tmp_path), str(metadata), data_file_keys=("image",), extra_inputs=("edit_image",),
                       file_inputs=("edit_image",))
    text = str(err.value)
    assert f"{metadata} row 3" in text and "'edit_image'" in text and "--data_file_keys image,edit_image" in text
    # every value a file name: loaded as files though --data_file_keys does not name it (as before)
    rows = json.loads(metadata.read_text())
    rows[2]["edit_image"] = ["e1.png"]
    metadata.write_text(json.dumps(rows))
    data = UnifiedDataset(str(tmp_path), str(metadata), data_file_keys=("image",), extra_inputs=("edit_image",),
                          file_inputs=("edit_image",))
    assert "edit_image" in data.data_file_keys


def test_the_train_command_refuses_it_before_stage_1_encodes(tmp_path):
    """Through FLUX.2-klein's edit feature: the data set is refused when it is built, naming row 3."""
    from conftest import run_train
    from support.flux2 import KLEIN_4B, klein_model_paths, write_tiny_flux2_hub

    hub = write_tiny_flux2_hub(tmp_path / "hub")
    metadata = _edit_rows(tmp_path)
    with pytest.raises(UserError) as err:
        run_train("--task", "sft:data_process", "--dataset_base_path", tmp_path, "--dataset_metadata_path", metadata,
                  "--model_paths", json.dumps(klein_model_paths(hub)[1:]), "--family", "flux2", "--tokenizer_path",
                  hub / KLEIN_4B / "tokenizer", "--output_path", tmp_path / "cache", "--data_file_keys", "image",
                  "--extra_inputs", "edit_image", "--max_pixels", 1024, "--no_progress", "--lora_base_model", "dit")
    text = str(err.value)
    assert f"{metadata} row 3" in text and "--data_file_keys image,edit_image" in text, text
