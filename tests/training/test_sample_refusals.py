"""`difftune sample` refuses numbers that cannot make a sample, up front and in one line naming the flag, before
any model is read: NaN or infinite guidance or LoRA strength (a black image with exit 0 before), no steps, a
negative or absurd size, a strength outside (0, 1]."""

from __future__ import annotations

import json

import pytest

from difftune.cli.sample import main
from difftune.errors import UserError

NO_MODEL = ["--model_paths", json.dumps(["/nonexistent/model.safetensors"]), "--prompt", "a cat"]


@pytest.mark.parametrize("flags, says", [
    (("--cfg_scale", "nan"), "--cfg_scale nan: must be a finite number"),
    (("--cfg_scale", "inf"), "--cfg_scale inf: must be a finite number"),
    (("--lora", "x.safetensors", "--lora_alpha", "nan"), "--lora_alpha nan: must be a finite number"),
    (("--num_inference_steps", "0"), "--num_inference_steps 0: must be at least 1"),
    (("--height", "-64"), "--height -64: must be a positive number of pixels"),
    (("--width", "100000", "--height", "100000"), "--width 100000: at most 16384 pixels"),
    (("--denoising_strength", "1.5"), "--denoising_strength 1.5: must be in (0, 1]"),
    (("--num_frames", "0"), "--num_frames 0: must be at least 1"),
    (("--fps", "-1"), "--fps -1: must be a positive frame rate"),
])
def test_impossible_numbers_are_refused_before_any_model_is_read(flags, says):
    with pytest.raises(UserError) as err:
        main([*NO_MODEL, *flags])
    assert says in str(err.value) and "\n" not in str(err.value)


def test_a_size_the_model_cannot_make_is_noted_with_the_size_written(tmp_path, tiny_repo, capsys):
    """--height 33 wrote a 48-pixel-high picture without a word (the pipeline rounds up to its size factor, 16 for
    Qwen-Image); now one note names both flags' values and the size written, which is the file's."""
    from PIL import Image

    out = tmp_path / "odd.png"
    assert main(["--model_dir", str(tiny_repo), "--prompt", "a dog", "--height", "33", "--width", "40",
                 "--num_inference_steps", "1", "--torch_dtype", "float32", "--output", str(out)]) == 0
    notes = [line for line in capsys.readouterr().out.splitlines() if line.startswith("note:")]
    assert len(notes) == 1, notes
    assert "--height 33 -> 48" in notes[0] and "--width 40 -> 48" in notes[0] and "48x48" in notes[0], notes
    with Image.open(out) as image:
        assert image.size == (48, 48)
    assert main(["--model_dir", str(tiny_repo), "--prompt", "a dog", "--height", "32", "--width", "48",
                 "--num_inference_steps", "1", "--torch_dtype", "float32", "--output", str(out)]) == 0
    assert "note:" not in capsys.readouterr().out
