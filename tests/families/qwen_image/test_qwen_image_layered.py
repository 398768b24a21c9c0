"""Qwen-Image-Layered: recognition, RGBA data, sampling parity with diffusers' QwenImageLayeredPipeline, split training
and the reference's Layered training scripts on tiny models."""

import json
import os
import re
import shlex
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from difftune.core.units import run_unit
from difftune.errors import UserError
from difftune.families.qwen_image import QwenImagePipeline
from difftune.families.qwen_image.components import LORA_TARGET_MODULES
from difftune.models import ModelConfig
from support import (tiny_qwen_image_paths, write_layered_dataset, write_tiny_qwen_image,
                              write_tiny_qwen_image_layered)

from conftest import run_train

SCRIPTS = Path(__file__).resolve().parents[2] / "reference_scripts" / "qwen_image" / "model_training"


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return write_tiny_qwen_image_layered(tmp_path_factory.mktemp("layered"))


@pytest.fixture(scope="module")
def pipe(repo):
    paths = tiny_qwen_image_paths(repo)
    return QwenImagePipeline.from_pretrained(
        torch_dtype=torch.float32, device="cpu",
        model_configs=[ModelConfig(paths["transformer"]), ModelConfig(paths["text_encoder"]),
                       ModelConfig(paths["vae"][0])],
        tokenizer_config=ModelConfig(str(repo / "tokenizer")))


def test_official_layered_configs_differ_from_qwen_image_in_their_weights():
    """Bare files are told apart by shape: the layered transformer has the "is RGB" embedding, the RGBA VAE reads
    and writes four channels; everything else is Qwen-Image's."""
    from difftune.families.qwen_image.components import DIT, VAE

    plain, layered = (DIT.signature(DIT.known_configs[k]) for k in
                      ("Qwen/Qwen-Image transformer", "Qwen/Qwen-Image-Layered transformer"))
    assert set(layered) - set(plain) == {"time_text_embed.addition_t_embedding.weight"}
    assert layered["time_text_embed.addition_t_embedding.weight"] == (2, 3072) and set(plain) < set(layered)
    rgb, rgba = (VAE.signature(VAE.known_configs[k]) for k in ("Qwen/Qwen-Image VAE", "Qwen/Qwen-Image-Layered VAE (RGBA)"))
    assert rgba["encoder.conv_in.weight"][1] == 4 and rgb["encoder.conv_in.weight"][1] == 3
    assert {k for k in rgb if rgb[k] != rgba[k]} == {"encoder.conv_in.weight", "decoder.conv_out.weight",
                                                       "decoder.conv_out.bias"}


def test_bare_layered_weights_are_recognised_by_shape(repo, tmp_path):
    """Without config.json, tiny plain and layered weights each match their own config among both."""
    import dataclasses

    from difftune.families.qwen_image.components import DIT, VAE
    from difftune.models.detect import detect_component

    plain = write_tiny_qwen_image(tmp_path / "plain")
    for spec, folder in ((DIT, "transformer"), (VAE, "vae")):
        configs = {f"tiny {kind}": json.loads((r / folder / "config.json").read_text())
                   for kind, r in (("plain", plain), ("layered", repo))}
        tiny = dataclasses.replace(spec, known_configs=configs)
        for kind, r in (("plain", plain), ("layered", repo)):
            bare = tmp_path / f"{kind}_{folder}"
            bare.mkdir()
            files = [shutil.copy(p, bare) for p in tiny_qwen_image_paths(r)[folder]]
            found = detect_component(ModelConfig(files if len(files) > 1 else files[0]), [tiny])
            assert found.source == f"weights match tiny {kind}"


def _diffusers_layered(pipe, repo, monkeypatch):
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_layered as layered
    from diffusers import FlowMatchEulerDiscreteScheduler, QwenImageLayeredPipeline

    # diffusers sizes the output from a 640/1024 resolution bucket; the tiny test keeps 64x48
    monkeypatch.setattr(layered, "calculate_dimensions", lambda area, ratio: (64, 48))
    scheduler = FlowMatchEulerDiscreteScheduler.from_pretrained(str(repo), subfolder="scheduler")
    ref = QwenImageLayeredPipeline(scheduler=scheduler, vae=pipe.vae, text_encoder=pipe.text_encoder,
                                   tokenizer=pipe.tokenizer, processor=None, transformer=pipe.dit)
    ref.set_progress_bar_config(disable=True)
    return ref


@pytest.mark.parametrize("cfg", [1.0, 4.0])
def test_sampling_equals_diffusers_layered_pipeline(pipe, repo, tmp_path, monkeypatch, cfg):
    """Same seed, prompt embeddings, steps and input image: the same layer latents and RGBA layers as diffusers."""
    write_layered_dataset(tmp_path, n=1, size=(64, 48))
    image = Image.open(tmp_path / "sample_1" / "input.png")
    ref = _diffusers_layered(pipe, repo, monkeypatch)
    values = {"prompt": ["three shapes"], "negative_prompt": ["blurry"]}
    run_unit(pipe, pipe.units[-1], values, cfg=True)
    embeds = dict(prompt_embeds=values["prompt_embeds"], prompt_embeds_mask=values["prompt_embeds_mask"])
    if cfg != 1.0:
        embeds.update(negative_prompt_embeds=values["negative_prompt_embeds"],
                      negative_prompt_embeds_mask=values["negative_prompt_embeds_mask"])
    grabbed = {}

    def grab(_, i, t, kwargs):
        grabbed["latents"] = kwargs["latents"]
        return {}

    theirs = ref(image=image, prompt="three shapes", true_cfg_scale=cfg, layers=2, num_inference_steps=3,
                 generator=torch.Generator().manual_seed(7), output_type="pt", callback_on_step_end=grab,
                 **embeds).images[0]
    kwargs = dict(negative_prompt="blurry", cfg_scale=cfg, height=48, width=64, num_inference_steps=3, seed=7,
                  layer_input_image=image, layer_num=2, progress=False)
    latents = pipe("three shapes", output_type="latent", **kwargs)
    images = pipe("three shapes", output_type="pt", **kwargs)
    assert latents.shape == (1, 16, 3, 6, 8)
    theirs_latents = ref._unpack_latents(grabbed["latents"], 48, 64, 2, 8)
    assert (latents - theirs_latents).abs().max().item() <= 1e-5  # measured 0.0
    # diffusers leaves out the first layer (the composite); it decodes the same RGBA layers after it
    assert images.shape == (1, 3, 4, 48, 64) and theirs.shape == (2, 4, 48, 64)
    assert (images[0, 1:] - theirs).abs().max().item() <= 1e-5  # measured 2.4e-7
    pil = pipe("three shapes", **kwargs)
    assert [i.mode for i in pil] == ["RGBA"] * 3 and pil[0].size == (64, 48)


def test_dataset_keeps_the_alpha_of_rgba_layers(tmp_path):
    from conftest import setup_run

    from difftune.cache.codec import images_from_cache, images_to_cache
    from difftune.training.builders import make_dataset

    meta = write_layered_dataset(tmp_path, n=1, size=(32, 32), layer_num=2)
    flags = ["--dataset_base_path", str(tmp_path), "--family", "qwen_image", "--output_path", str(tmp_path / "out")]
    run = setup_run(*flags, "--dataset_metadata_path", str(meta), "--data_file_keys", "image,layer_input_image",
                    "--extra_inputs", "layer_num,layer_input_image")
    assert run.pipeline.__name__ == "QwenImageLayeredPipeline"  # the layer columns choose it
    item = make_dataset(run)[0]
    layers = item["image"]
    assert [i.mode for i in layers] == ["RGBA"] * 3 and item["layer_input_image"].mode == "RGBA"
    on_disk = np.asarray(Image.open(tmp_path / "sample_1" / "layer_2.png"))
    assert np.array_equal(np.asarray(layers[2]), on_disk)
    assert {0, 195} <= set(np.unique(on_disk[..., 3]).tolist())  # transparent around a 195-alpha shape
    # every layer and the input image are the row's source files (a stale cache is found by them)
    dataset = make_dataset(run)
    assert sorted(Path(f).relative_to(tmp_path).as_posix() for f in dataset.source_files(0)) == [
        "sample_1/input.png", "sample_1/layer_0.png", "sample_1/layer_1.png", "sample_1/layer_2.png"]
    back = images_from_cache(images_to_cache(layers))
    assert all(np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(back, layers))
    # a single `image` (plain Qwen-Image) is still loaded as RGB
    (tmp_path / "one.csv").write_text("image,prompt\nsample_1/layer_0.png,a\n")
    run = setup_run(*flags, "--dataset_metadata_path", str(tmp_path / "one.csv"), "--data_file_keys", "image")
    assert run.pipeline.__name__ == "QwenImagePipeline"
    assert make_dataset(run)[0]["image"].mode == "RGB"


def test_units_encode_the_stack_and_the_input_image(pipe, tmp_path):
    meta = write_layered_dataset(tmp_path, n=1, size=(32, 48), layer_num=2)
    row = json.loads(meta.read_text())[0]
    data = {"image": [Image.open(tmp_path / f) for f in row["image"]], "prompt": row["prompt"], "_row": 0,
            "layer_input_image": Image.open(tmp_path / row["layer_input_image"]), "layer_num": 2}
    pipe.scheduler.training = True
    try:
        values = pipe.run_units(pipe.training_inputs(data))
    finally:
        pipe.scheduler.training = False
    assert values["noise"].shape == (1, 16, 3, 6, 4) and values["input_latents"].shape == (1, 16, 3, 6, 4)
    assert values["layer_input_latents"].shape == (1, 16, 6, 4)
    from difftune.families.qwen_image.units import vae_encode
    from difftune.media.image import images_to_tensor

    second = vae_encode(pipe, images_to_tensor(data["image"][1], mode="RGBA"))
    assert torch.allclose(values["input_latents"][:, :, 1], second, atol=1e-6)
    # the composite and the input image are the same picture here
    assert torch.allclose(values["input_latents"][:, :, 0], values["layer_input_latents"], atol=1e-6)


def test_bad_layered_rows_are_one_line_errors(pipe):
    layer = Image.new("RGBA", (32, 32))
    good = {"image": [layer, layer], "layer_input_image": layer, "layer_num": 1, "prompt": "p", "_row": 4}
    pipe.training_inputs(good)
    for bad, message in [({"layer_num": 3}, "row 5: layer_num is 3 but 'image' lists 2 layers"),
                         ({"layer_input_image": None}, "row 5: Qwen-Image-Layered needs 'layer_input_image'"),
                         ({"image": [layer, Image.new("RGBA", (16, 32))]}, "row 5: the layers of 'image' differ"),
                         ({"layer_num": -1}, "row 5: layer_num must be a whole number >= 0")]:
        with pytest.raises(UserError, match=re.escape(message)) as err:
            pipe.training_inputs({**good, **bad})
        assert "\n" not in str(err.value)


def test_layered_data_with_an_rgb_vae_is_refused(tmp_path):
    repo = write_tiny_qwen_image(tmp_path / "plain")
    paths = tiny_qwen_image_paths(repo)
    from difftune.families.qwen_image import QwenImageLayeredPipeline

    # weights alone give the plain pipeline; the layered one named on purpose refuses the RGB VAE
    assert type(QwenImagePipeline.from_pretrained(torch_dtype=torch.float32, model_configs=[
        ModelConfig(paths["vae"][0])])) is QwenImagePipeline
    plain = QwenImageLayeredPipeline.from_pretrained(torch_dtype=torch.float32,
                                                     model_configs=[ModelConfig(paths["vae"][0])])
    layer = Image.new("RGBA", (32, 32))
    values = {"layer_images": [layer, layer], "height": 32, "width": 32}
    stack = next(u for u in plain.units if u.name == "QwenImageLayerStackEmbedder")
    with pytest.raises(UserError, match="needs its RGBA VAE .* reads 3 channels"):
        run_unit(plain, stack, values)


def test_layer_stacks_with_a_plain_transformer_are_refused(pipe, tmp_path):
    from difftune.families.qwen_image.layered import model_fn_qwen_image_layered
    from support import tiny_qwen_transformer, TinyQwenImageSpec

    plain = tiny_qwen_transformer(TinyQwenImageSpec())
    latents, condition = torch.zeros(1, 16, 2, 4, 4), torch.zeros(1, 16, 4, 4)
    with pytest.raises(UserError, match="need Qwen-Image-Layered's transformer .layer-3D RoPE.; the transformer "
                                        "loaded is a plain Qwen-Image one"):
        model_fn_qwen_image_layered(plain, latents, torch.ones(1), torch.zeros(1, 3, 32), None, condition)
    with pytest.raises(UserError, match="the transformer is Qwen-Image-Layered's: it generates a stack of layers"):
        pipe.model_fn(torch.zeros(1, 16, 4, 4), torch.ones(1), torch.zeros(1, 3, 32))


def _layered_run(repo, meta, out, *extra):
    paths = tiny_qwen_image_paths(repo)
    return ["--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--data_file_keys",
            "image,layer_input_image", "--extra_inputs", "layer_num,layer_input_image", "--max_pixels", "4096",
            "--learning_rate", "1e-3", "--num_epochs", "1", "--lora_base_model", "dit", "--lora_target_modules",
            LORA_TARGET_MODULES, "--lora_rank", "4", "--remove_prefix_in_ckpt", "pipe.dit.", "--output_path", out,
            "--torch_dtype", "float32", "--model_paths", json.dumps([paths[c] for c in extra[0]]), *extra[1:]]


def test_split_lora_training_equals_one_stage(repo, tmp_path):
    from safetensors.torch import load_file

    meta = write_layered_dataset(tmp_path / "data", n=2, size=(32, 32), layer_num=2)
    everything = ("transformer", "text_encoder", "vae")
    run_train(*_layered_run(repo, meta, tmp_path / "one", everything, "--use_gradient_checkpointing"))
    run_train(*_layered_run(repo, meta, tmp_path / "cache", ("text_encoder", "vae"), "--task", "sft:data_process"))
    stage2 = _layered_run(repo, meta, tmp_path / "two", ("transformer",), "--task", "sft:train")
    at = stage2.index("--dataset_metadata_path")
    del stage2[at:at + 2]
    stage2[stage2.index("--dataset_base_path") + 1] = tmp_path / "cache"
    run_train(*stage2)
    one, two = (load_file(str(tmp_path / d / "epoch-0.safetensors")) for d in ("one", "two"))
    assert one.keys() == two.keys() and len(one) > 0
    assert max((one[k] - two[k]).abs().max().item() for k in one) <= 1e-5  # measured 0.0
    assert max(one[k].abs().max().item() for k in one if "lora_B" in k) > 0  # the LoRA trained


def _script_args(script: Path) -> list[str]:
    """The arguments the reference script hands its train.py (the accelerate launcher and its config left out)."""
    text = script.read_text().replace("\\\n", " ")
    line = next(ln for ln in text.splitlines() if ln.startswith("accelerate launch"))
    tokens = shlex.split(line)
    return tokens[next(i for i, t in enumerate(tokens) if t.endswith("train.py")) + 1:]


def _reference_workspace(root: Path, dataset: str, transformer_repo: str, layer_num: int) -> None:
    """Tiny models where the script's hub ids resolve (./models/<id>/) and its data set where it looks."""
    layered = write_tiny_qwen_image_layered(root / "models" / transformer_repo)
    if transformer_repo != "Qwen/Qwen-Image-Layered":
        shutil.copytree(layered / "vae", root / "models" / "Qwen" / "Qwen-Image-Layered" / "vae")
    plain = root / "models" / "Qwen" / "Qwen-Image"
    plain.mkdir(parents=True)
    for folder in ("text_encoder", "tokenizer"):
        shutil.copytree(layered / folder, plain / folder)
    write_layered_dataset(root / "data" / "diffsynth_example_dataset" / "qwen_image" / dataset, n=2, size=(32, 32),
                          layer_num=layer_num)


@pytest.mark.slow
@pytest.mark.parametrize("script, repo_id, layer_num", [
    ("lora/Qwen-Image-Layered.sh", "Qwen/Qwen-Image-Layered", 2),
    ("lora/Qwen-Image-Layered-Control.sh", "DiffSynth-Studio/Qwen-Image-Layered-Control", 0),
    ("full/Qwen-Image-Layered.sh", "Qwen/Qwen-Image-Layered", 1),
])
def test_reference_layered_scripts_train(tmp_path, monkeypatch, script, repo_id, layer_num):
    """The reference's command line, `difftune train` for its launcher, on its data layout (metadata.json with
    `image` a list of RGBA layers, `layer_input_image`, `layer_num`): two steps, and the checkpoint is written."""
    from safetensors.torch import load_file

    args = _script_args(SCRIPTS / script)
    dataset = Path(args[args.index("--dataset_base_path") + 1]).name
    _reference_workspace(tmp_path, dataset, repo_id, layer_num)
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("DIFFTUNE_MODEL_BASE_PATH", str(tmp_path / "models"))
    out = args[args.index("--output_path") + 1]
    args[args.index("--dataset_num_workers") + 1] = "0"  # two CPU cores here
    run_train(*args, "--max_steps", "2", "--torch_dtype", "float32")
    files = sorted(os.listdir(tmp_path / out))
    checkpoint = next(f for f in files if f.endswith(".safetensors"))
    weights = load_file(str(tmp_path / out / checkpoint))
    if script.startswith("lora/"):
        assert all(".lora_" in k or k.endswith(".alpha") for k in weights) and len(weights) > 0
    else:
        assert "time_text_embed.addition_t_embedding.weight" in weights  # the whole layered transformer


def test_sample_command_writes_one_rgba_png_per_layer(repo, tmp_path, capsys):
    from difftune.cli.main import main

    write_layered_dataset(tmp_path / "data", n=1, size=(32, 32))
    out = tmp_path / "layers.png"
    code = main(["sample", "--model_dir", str(repo), "--prompt", "shapes", "--layer_input_image",
                 str(tmp_path / "data" / "sample_1" / "input.png"), "--layer_num", "2", "--height", "32", "--width",
                 "32", "--num_inference_steps", "2", "--torch_dtype", "float32", "--output", str(out)])
    assert code == 0
    written = [tmp_path / f"layers-layer{k}.png" for k in range(3)]
    assert capsys.readouterr().out.splitlines()[-3:] == [str(p) for p in written]
    assert [Image.open(p).mode for p in written] == ["RGBA"] * 3
