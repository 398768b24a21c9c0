"""The bundled tiny base model and `difftune demo` (the README's first command)."""

import json
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

from difftune.demo import BUNDLED_MODEL, main as demo_main
from difftune.shapes import COLORS, ShapeSpec, aligned_iou, classify_shape, foreground_mask, render


def _components(root):
    return {
        "transformer": sorted(str(p) for p in (root / "transformer").glob("diffusion_pytorch_model*.safetensors")),
        "text_encoder": sorted(str(p) for p in (root / "text_encoder").glob("model*.safetensors")),
        "vae": [str(root / "vae" / "diffusion_pytorch_model.safetensors")],
    }


def test_bundled_model_is_small_and_in_the_official_layout():
    index = json.loads((BUNDLED_MODEL / "model_index.json").read_text())
    assert index["_class_name"] == "QwenImagePipeline"
    assert index["transformer"] == ["diffusers", "QwenImageTransformer2DModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKLQwenImage"]
    assert index["text_encoder"] == ["transformers", "Qwen2_5_VLForConditionalGeneration"]
    for folder in ("transformer", "text_encoder", "vae"):
        assert (BUNDLED_MODEL / folder / "config.json").is_file()
    assert (BUNDLED_MODEL / "tokenizer" / "tokenizer.json").is_file()
    assert (BUNDLED_MODEL / "scheduler" / "scheduler_config.json").is_file()
    files = [p for p in BUNDLED_MODEL.rglob("*") if p.is_file()]
    assert not [p for p in files if p.suffix in (".bin", ".pt", ".pth", ".ckpt")]  # safetensors + json only
    assert sum(p.stat().st_size for p in files) < 12 * 2**20


@pytest.fixture(scope="module")
def hub_pipeline(tmp_path_factory):
    """The bundled model loaded by hub id + file patterns, exactly as `Qwen/Qwen-Image` is."""
    from difftune.models import ModelConfig
    from difftune.families.qwen_image import QwenImagePipeline

    base = tmp_path_factory.mktemp("hub")
    shutil.copytree(BUNDLED_MODEL, base / "Qwen" / "Qwen-Image")
    patterns = ["transformer/diffusion_pytorch_model*.safetensors", "text_encoder/model*.safetensors",
                "vae/diffusion_pytorch_model.safetensors"]
    configs = [ModelConfig(model_id="Qwen/Qwen-Image", origin_file_pattern=p, local_model_path=str(base),
                           skip_download=True) for p in patterns]
    tokenizer = ModelConfig(model_id="Qwen/Qwen-Image", origin_file_pattern="tokenizer/", local_model_path=str(base),
                            skip_download=True)
    return QwenImagePipeline.from_pretrained(torch_dtype=torch.float32, model_configs=configs,
                                             tokenizer_config=tokenizer)


def test_bundled_model_loads_like_real_weights(hub_pipeline):
    """Hub-id loading and plain file paths give the same model (the path real weights take)."""
    from difftune.models import ModelConfig
    from difftune.families.qwen_image import QwenImagePipeline

    files = _components(BUNDLED_MODEL)
    by_path = QwenImagePipeline.from_pretrained(
        torch_dtype=torch.float32, model_configs=[ModelConfig(path=files[c]) for c in files],
        tokenizer_config=ModelConfig(path=str(BUNDLED_MODEL / "tokenizer")))
    assert type(hub_pipeline.dit).__name__ == "QwenImageTransformer2DModel"
    assert type(hub_pipeline.vae).__name__ == "AutoencoderKLQwenImage"
    assert type(hub_pipeline.text_encoder).__name__ == "Qwen2_5_VLForConditionalGeneration"
    for name in ("dit", "vae", "text_encoder"):
        a, b = getattr(hub_pipeline, name).state_dict(), getattr(by_path, name).state_dict()
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_bundled_model_draws_the_prompted_shape_and_colours(hub_pipeline):
    """The pretrained base model is not random: it draws the shape and colours a prompt asks for."""
    cases = [("circle", "red", "blue"), ("square", "yellow", "black"), ("triangle", "white", "green"),
             ("circle", "blue", "yellow"), ("square", "black", "white"), ("triangle", "green", "red")]
    prompts = [ShapeSpec(*c).prompt for c in cases]
    images = hub_pipeline(prompts, cfg_scale=3.0, height=64, width=64, num_inference_steps=20, seed=0, progress=False)
    right_shape = 0
    for image, (shape, fg, bg) in zip(images, cases):
        a = np.asarray(image, dtype=np.float32)
        mask = foreground_mask(image, fg, bg)
        assert 0.03 < mask.mean() < 0.6, (shape, fg, bg)  # a figure on a ground, not one flat colour
        # the ground has the prompt's background colour
        assert np.abs(a[~mask].mean(0) - np.asarray(COLORS[bg])).max() < 60, (shape, fg, bg)
        right_shape += classify_shape(mask, ("circle", "square", "triangle")) == shape
    assert right_shape >= 4


def test_star_metric_separates_stars_from_other_shapes():
    for color, background in (("red", "blue"), ("white", "black")):
        star = foreground_mask(render(ShapeSpec("star", color, background, 30, 35, 16)), color, background)
        circle = foreground_mask(render(ShapeSpec("circle", color, background, 30, 35, 16)), color, background)
        assert aligned_iou(star, "star") > 0.9
        assert aligned_iou(circle, "star") < 0.75
        assert classify_shape(star) == "star" and classify_shape(circle) == "circle"
    assert aligned_iou(np.zeros((64, 64), bool), "star") == 0.0


def test_demo_short_run_writes_everything_and_learns_the_star(tmp_path, capsys):
    out = tmp_path / "demo"
    assert demo_main(["--output", str(out), "--steps", "300", "--sample_steps", "12", "--seeds", "1",
                      "--no_progress"]) == 0
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 300
    lora = out / "lora" / "epoch-0.safetensors"
    assert summary["lora"] == str(lora) and lora.is_file()
    assert (out / "cache" / "manifest.json").is_file()
    assert len(list((out / "data").glob("star_*.png"))) == 60
    for stage in ("stage1_data_process", "stage2_train", "samples_before", "samples_after"):
        assert summary["stages"][stage]["seconds"] > 0
        assert 50 < summary["stages"][stage]["peak_rss_mib"] < 8192
    metric = summary["metric"]
    # the samples became more star-like (measured here: IoU 0.623 -> 0.686, stars 0 % -> 50 %)
    assert metric["after"] > metric["before"] + 0.03
    assert metric["star_fraction_after"] >= metric["star_fraction_before"] + 0.25
    assert metric["improvement"] == pytest.approx(metric["after"] - metric["before"], abs=1e-3)
    grid = Image.open(out / "samples.png")
    assert grid.size[0] > 5 * 64 and grid.size[1] > 3 * 64  # 5 prompts x (before, after, reference)
    assert Image.open(out / "loss.png").size == (640, 360)
    assert "star IoU" in capsys.readouterr().out


def test_demo_refuses_bad_arguments_in_one_line(tmp_path, capsys):
    from difftune.cli.main import main

    assert main(["demo", "--output", str(tmp_path / "x"), "--steps", "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("error: --steps") and "\n" not in err
    assert main(["demo", "--output", str(tmp_path / "y"), "--model_dir", str(tmp_path / "nowhere")]) == 2
    err = capsys.readouterr().err.strip()
    assert "--model_dir" in err and "\n" not in err


def test_example_workspace_writes_a_tiny_model_where_its_hub_id_resolves_and_a_data_set(tmp_path, capsys):
    """`difftune example-workspace DIR` (the README's second command): the tiny random Qwen-Image at
    DIR/models/Qwen/Qwen-Image in the official layout, recognised from its weights, and the 4-image data set."""
    from difftune.cli.main import main
    from difftune.core.family import recognise
    from difftune.models import ModelConfig

    assert main(["example-workspace", str(tmp_path / "ws")]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(tmp_path / "ws")
    repo = tmp_path / "ws" / "models" / "Qwen" / "Qwen-Image"
    assert json.loads((repo / "model_index.json").read_text())["_class_name"] == "QwenImagePipeline"
    files = _components(repo)
    assert len(files["transformer"]) > 1 and len(files["text_encoder"]) > 1  # sharded, as the hub's
    assert (repo / "tokenizer" / "tokenizer.json").is_file()
    spec, found = recognise([ModelConfig(path=files[c]) for c in files], None, log=lambda *a: None)
    assert spec.name == "qwen_image" and sorted(slot for slot, _, _ in found) == ["dit", "text_encoder", "vae"]
    data = tmp_path / "ws" / "data" / "example_image_dataset"
    rows = (data / "metadata.csv").read_text().splitlines()
    assert rows[0] == "image,prompt" and len(rows) == 5
    assert all((data / row.split(",")[0]).is_file() for row in rows[1:])
