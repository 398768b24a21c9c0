"""Qwen-Image-Edit-2509 / -2511 (Edit-Plus): several edit images per prompt. Sampling equals diffusers'
QwenImageEditPlusPipeline (and its 2511 zero_cond_t handling), split training equals one-stage training with two
edit images, batches of several images per sample, and the data format's errors."""

import json

import pytest
import torch
from PIL import Image, ImageDraw

from conftest import LORA_TARGETS, make_image_dataset, model_paths_json, run_train
from difftune.core.units import run_unit
from difftune.errors import UserError
from difftune.families.qwen_image import QwenImagePipeline
from difftune.families.qwen_image import edit_plus
from difftune.families.qwen_image.edit_plus import (EDIT_PLUS_PROMPT_TEMPLATE, condition_image, edit_groups,
                                                    edit_latent_batches)
from difftune.families.qwen_image.model_fn import model_fn_qwen_image
from difftune.families.qwen_image.units import template_drop_count
from difftune.models import ModelConfig
from support import (TinyQwenImageSpec, diffusers_qwen_image_edit, tiny_qwen_image_paths,
                              write_tiny_qwen_image)

VAE_AREA = 64 * 64  # the VAE side's 1 MP scaled down on both sides (a tiny VAE at 1 MP takes ~15 s an image)


@pytest.fixture(scope="module")
def repo(tmp_path_factory):
    return write_tiny_qwen_image(tmp_path_factory.mktemp("edit_2509"), edit_plus=True)


@pytest.fixture(scope="module")
def repo_2511(tmp_path_factory):
    # the same weights as `repo` (same seeds); the transformer's config says zero_cond_t, as Edit-2511's does
    return write_tiny_qwen_image(tmp_path_factory.mktemp("edit_2511"), TinyQwenImageSpec(zero_cond_t=True),
                                 edit_plus=True)


def load_pipe(root):
    paths = tiny_qwen_image_paths(root)
    return QwenImagePipeline.from_pretrained(
        torch_dtype=torch.float32, device="cpu",
        model_configs=[ModelConfig(paths["transformer"]), ModelConfig(paths["text_encoder"]),
                       ModelConfig(paths["vae"][0])],
        tokenizer_config=ModelConfig(str(root / "tokenizer")), processor_config=ModelConfig(str(root / "processor")))


@pytest.fixture(scope="module")
def pipe(repo):
    return load_pipe(repo)


@pytest.fixture(scope="module")
def theirs(repo, pipe):
    d = diffusers_qwen_image_edit(repo)
    # diffusers hard-codes the official tokenizer's 64; the tiny byte-level tokenizer needs its own count
    d.prompt_template_encode_start_idx = template_drop_count(pipe.tokenizer, EDIT_PLUS_PROMPT_TEMPLATE)
    return d


@pytest.fixture()
def small_vae_area(monkeypatch):
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit_plus as dp

    monkeypatch.setattr(dp, "VAE_IMAGE_SIZE", VAE_AREA)
    monkeypatch.setattr(edit_plus, "VAE_IMAGE_AREA", VAE_AREA)


def pictures():
    a = Image.new("RGB", (64, 48), (200, 30, 30))
    ImageDraw.Draw(a).ellipse((10, 10, 40, 30), fill=(20, 200, 20))
    b = Image.new("RGB", (48, 64), (30, 30, 200))
    ImageDraw.Draw(b).rectangle((5, 5, 20, 40), fill=(250, 250, 0))
    return a, b


def sample(p, images, cfg, **kw):
    kw.setdefault("output_type", "pt")
    return p("put the square beside the circle", negative_prompt="blurry", edit_image=images, cfg_scale=cfg,
             height=64, width=48, num_inference_steps=2, seed=7, progress=False, **kw)


def sample_diffusers(d, images, cfg):
    return d(image=images, prompt="put the square beside the circle", negative_prompt="blurry", true_cfg_scale=cfg,
             height=64, width=48, num_inference_steps=2, generator=torch.Generator().manual_seed(7),
             output_type="pt").images


@pytest.mark.parametrize("n", [1, 2])
@pytest.mark.parametrize("cfg", [1.0, 4.0])
def test_sampling_equals_diffusers_edit_plus(pipe, theirs, small_vae_area, n, cfg):
    images = list(pictures()[:n])
    ours = sample(pipe, images, cfg)
    ref = sample_diffusers(theirs, images, cfg)
    assert ours.shape == ref.shape == (1, 3, 64, 48)
    assert (ours - ref).abs().max().item() <= 1e-4
    assert ours.std() > 0.01


def test_zero_cond_t_with_two_images_equals_diffusers_2511(pipe, repo_2511, small_vae_area):
    """The flag on 2509's transformer config gives what diffusers computes from 2511's config (zero_cond_t=True),
    with two edit images: every edit image's tokens are modulated at t=0."""
    d = diffusers_qwen_image_edit(repo_2511)
    d.prompt_template_encode_start_idx = template_drop_count(pipe.tokenizer, EDIT_PLUS_PROMPT_TEMPLATE)
    assert d.transformer.config.zero_cond_t and not pipe.dit.config.zero_cond_t
    images = list(pictures())
    ours = sample(pipe, images, 4.0, zero_cond_t=True)
    ref = sample_diffusers(d, images, 4.0)
    assert (ours - ref).abs().max().item() <= 1e-4
    with_flag, without = (sample(pipe, images, 4.0, zero_cond_t=z, output_type="latent") for z in (True, False))
    assert (with_flag - without).abs().max().item() > 1e-3  # it matters (tiny random weights: a small effect)


def test_a_list_is_edit_plus_a_single_image_is_edit(pipe, theirs):
    """The template follows the type of `edit_image`, as in the reference: [image] gets "Picture 1:" and the
    condition-size image (equal to diffusers' Edit-Plus embeddings); a bare image gets Qwen-Image-Edit's template."""
    a, b = pictures()
    plus = run_unit(pipe, pipe.units[-1], {"prompt": ["make it red"], "edit_image": [a, b]})
    cond = [condition_image(a), condition_image(b)]
    assert [c.size for c in cond] == [(448, 320), (320, 448)]  # about 384x384, aspect kept, multiples of 32
    ref, ref_mask = theirs.encode_prompt(prompt=["make it red"], image=cond, device="cpu")
    assert plus["prompt_embeds"].shape == ref.shape
    assert (plus["prompt_embeds"] - ref).abs().max().item() <= 1e-5
    one_plus = run_unit(pipe, pipe.units[-1], {"prompt": ["make it red"], "edit_image": [a]})["prompt_embeds"]
    one_edit = run_unit(pipe, pipe.units[-1], {"prompt": ["make it red"], "edit_image": a})["prompt_embeds"]
    assert one_plus.shape != one_edit.shape or (one_plus - one_edit).abs().max() > 1e-3


def test_single_image_edit_still_equals_diffusers_edit(pipe, repo, monkeypatch):
    """A bare image keeps Qwen-Image-Edit's template and sizes (its prompt longer than 512 tokens is not cut,
    as in diffusers)."""
    import diffusers.pipelines.qwenimage.pipeline_qwenimage_edit as de
    from difftune.families.qwen_image import units

    d = diffusers_qwen_image_edit(repo, plus=False)
    d.prompt_template_encode_start_idx = template_drop_count(pipe.tokenizer, units.EDIT_PROMPT_TEMPLATE)
    size, dims = units.edit_image_size, de.calculate_dimensions
    monkeypatch.setattr(edit_plus, "edit_image_size", lambda w, h, area=0: size(w, h, area=VAE_AREA))  # the unit's
    monkeypatch.setattr(de, "calculate_dimensions", lambda area, ratio: dims(VAE_AREA, ratio))
    a = pictures()[0]
    prompt = "make the circle blue " * 30  # with the image's tokens, past 512 after the template
    ours = pipe(prompt, negative_prompt="blurry", edit_image=a, cfg_scale=4.0, height=64, width=48,
                num_inference_steps=2, seed=7, progress=False, output_type="pt")
    ref = d(image=a, prompt=prompt, negative_prompt="blurry", true_cfg_scale=4.0, height=64, width=48,
            num_inference_steps=2, generator=torch.Generator().manual_seed(7), output_type="pt").images
    assert (ours - ref).abs().max().item() <= 1e-4


def _edit_unit(pipe):
    return next(u for u in pipe.units if type(u).__name__ == "QwenImageEditImageEmbedder")


def test_each_edit_image_is_encoded_at_its_own_size_and_gets_its_img_shape(pipe, monkeypatch):
    a, b = pictures()
    values = run_unit(pipe, _edit_unit(pipe), {"edit_image": [a, b], "edit_image_auto_resize": False, "batch_size": 1})
    latents = values["edit_latents"]
    assert [[tuple(t.shape) for t in s] for s in latents] == [[(16, 6, 8), (16, 8, 6)]]
    assert values["edit_image"] == [a, b]  # the originals stay: the VL encoder sees them at the condition size
    monkeypatch.setattr(edit_plus, "VAE_IMAGE_AREA", 128 * 128)  # 1 MP in the pipeline
    resized = run_unit(pipe, _edit_unit(pipe), {"edit_image": [a, b], "edit_image_auto_resize": True, "batch_size": 1})
    # about VAE_IMAGE_AREA each, from each image's own aspect ratio (no longer the first image's size)
    assert [tuple(t.shape) for t in resized["edit_latents"][0]] == [(16, 12, 20), (16, 20, 12)]
    seen = {}
    real = pipe.dit.forward
    monkeypatch.setattr(pipe.dit, "forward", lambda *args, **kw: seen.update(kw) or real(*args, **kw))
    model_fn_qwen_image(pipe.dit, torch.zeros(1, 16, 8, 6), torch.tensor([500.0]), torch.zeros(1, 3, 32),
                        torch.ones(1, 3, dtype=torch.long), edit_latents=latents)
    assert seen["img_shapes"] == [[(1, 4, 3), (1, 3, 4), (1, 4, 3)]]
    assert seen["hidden_states"].shape[1] == 12 + 12 + 12


def test_a_batch_of_multi_image_samples_equals_one_at_a_time(pipe):
    g = torch.Generator().manual_seed(0)
    samples = [[torch.randn(16, 4, 6, generator=g), torch.randn(16, 6, 4, generator=g)] for _ in range(2)]
    latents, emb = torch.randn(2, 16, 4, 4, generator=g), torch.randn(2, 5, 32, generator=g)
    mask, t = torch.ones(2, 5, dtype=torch.long), torch.tensor([300.0, 800.0])
    with torch.no_grad():
        both = model_fn_qwen_image(pipe.dit, latents, t, emb, mask, edit_latents=samples)
        for i in range(2):
            one = model_fn_qwen_image(pipe.dit, latents[i:i + 1], t[i:i + 1], emb[i:i + 1], mask[i:i + 1],
                                      edit_latents=[samples[i]])
            assert (both[i:i + 1] - one).abs().max().item() < 1e-5
    with pytest.raises(UserError, match=r"sample 2 has \[\(4, 6\)\]"):
        edit_latent_batches([samples[0], samples[1][:1]], 2, latents)


def test_edit_image_forms():
    a, b = pictures()
    assert edit_groups(a, 2) is None  # Qwen-Image-Edit, one image for the batch
    assert edit_groups([a, b], 2) is None  # Qwen-Image-Edit, a stage-1 batch of two samples
    assert edit_groups([a, b], 1) == [[a, b]]  # Edit-Plus, one sample
    assert edit_groups([[a, b], [b]], 2) == [[a, b], [b]]  # Edit-Plus, a stage-1 batch
    with pytest.raises(UserError, match="must be an image"):
        edit_groups(["edit_1.png"], 1)


def test_a_list_of_one_edit_image_stays_edit_plus_through_the_cache(pipe):
    """Stage 1 encodes a batch of one sample as that sample's own values: a list of one edit image must come out
    of the split (into the cache) as a list, not as the bare image that would read as Qwen-Image-Edit."""
    from difftune.core.batch import split_batch
    from difftune.cache.codec import images_from_cache, images_to_cache

    a, b = pictures()
    for group in ([a], [a, b]):
        values = pipe.training_inputs_batch([{"image": a, "edit_image": group, "prompt": "x", "_row": 0}])
        assert edit_groups(values["edit_image"], values["batch_size"]) == [group]
        cached = split_batch(values, 1, pipe.batching, ["edit_image"])[0]["edit_image"]
        back = images_from_cache(images_to_cache(cached))  # images of different sizes, one tensor each
        assert isinstance(back, list) and [i.size for i in back] == [i.size for i in group]
        assert edit_groups(back, 1) is not None


def test_edit_image_file_names_nobody_loaded_are_no_input(pipe, capsys, monkeypatch):
    """As the reference: without --extra_inputs edit_image the column is not an input (Edit-2509-LoRA-NPU.sh);
    said once."""
    monkeypatch.setattr(edit_plus, "_noted", set())
    a = pictures()[0]
    for value in (["edit_1.png", "edit_2.png"], "edit_1.png"):
        assert pipe.training_inputs({"image": a, "prompt": "x", "edit_image": value})["edit_image"] is None
    assert capsys.readouterr().out.count("'edit_image' column is not used") == 1
    assert pipe.training_inputs({"image": a, "prompt": "x", "edit_image": [a]})["edit_image"] == [a]


def write_edit_plus_data(root, rows):
    make_image_dataset(root, n=len(rows), size=(32, 32))
    colors = [(200, 40, 40), (40, 200, 40), (40, 40, 200), (200, 200, 40)]
    meta = []
    for i, sizes in enumerate(rows):
        names = []
        for j, size in enumerate(sizes):
            names.append(f"edit_{i + 1}_{j + 1}.png")
            Image.new("RGB", size, colors[(i + j) % 4]).save(root / names[-1])
        meta.append({"image": f"image_{i + 1}.png", "edit_image": names, "prompt": f"combine them {i}"})
    (root / "metadata.json").write_text(json.dumps(meta, indent=1))
    return root / "metadata.json"


def common(models, *extra, repeat=1):
    return ["--max_pixels", 4096, "--learning_rate", 1e-3, "--num_epochs", 2, "--dataset_repeat", repeat,
            "--model_paths", models, "--torch_dtype", "float32", "--no_progress", "--seed", 3,
            "--data_file_keys", "image,edit_image", "--extra_inputs", "edit_image", "--edit_image_auto_resize", "false",
            "--lora_base_model", "dit", "--lora_target_modules", LORA_TARGETS, "--lora_rank", 4, *extra]


def max_diff(a_path, b_path):
    from safetensors.torch import load_file

    a, b = load_file(str(a_path)), load_file(str(b_path))
    assert a.keys() == b.keys() and a
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("zero_cond_t", [False, True])
def test_dit_lora_split_equals_one_stage_with_two_edit_images(tmp_path, repo, zero_cond_t):
    """Edit-2509 (and 2511 with --zero_cond_t): two samples with two edit images of different sizes share
    batches of 2, a third with one image (a list of one: Edit-Plus) is its own bucket; stage 1 encodes in batches."""
    meta = write_edit_plus_data(tmp_path / "data", [[(32, 48), (48, 32)], [(32, 48), (48, 32)], [(48, 48)]])
    models = model_paths_json(repo)
    flags = ["--batch_size", 2, *(["--zero_cond_t"] if zero_cond_t else [])]
    data = meta.parent
    run_train("--task", "sft", "--dataset_base_path", data, "--dataset_metadata_path", meta,
              "--output_path", tmp_path / "one", *common(models, *flags))
    run_train("--task", "sft:data_process", "--dataset_base_path", data, "--dataset_metadata_path", meta,
              "--output_path", tmp_path / "cache", *common(models, *flags, repeat=1))
    run_train("--task", "sft:train", "--dataset_base_path", tmp_path / "cache", "--output_path", tmp_path / "two",
              *common(models, *flags))
    assert max_diff(tmp_path / "one" / "epoch-1.safetensors", tmp_path / "two" / "epoch-1.safetensors") <= 1e-5
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert "edit_latents" in manifest["frontier"]


def test_an_edit_image_list_naming_a_missing_file_is_one_line(tmp_path, repo):
    meta = write_edit_plus_data(tmp_path / "data", [[(32, 32), (32, 32)], [(32, 32)]])
    rows = json.loads(meta.read_text())
    rows[1]["edit_image"] = ["edit_2_1.png", "missing.png"]
    meta.write_text(json.dumps(rows))
    with pytest.raises(UserError) as err:
        run_train("--task", "sft", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
                  "--output_path", tmp_path / "out", *common(model_paths_json(repo)))
    message = str(err.value)
    assert "\n" not in message and "row 2" in message and "missing.png" in message and "edit_image" in message


def test_text_encoder_lora_split_equals_one_stage_with_two_edit_images(tmp_path, repo):
    """The prompt unit in stage 2: the cache holds each sample's edit images (of different sizes) as images."""
    meta = write_edit_plus_data(tmp_path / "data", [[(32, 48), (48, 32)], [(48, 48)]])
    models = model_paths_json(repo)
    flags = ["--lora_base_model", "text_encoder", "--lora_target_modules", "q_proj,v_proj"]
    data = meta.parent
    run_train("--task", "sft", "--dataset_base_path", data, "--dataset_metadata_path", meta,
              "--output_path", tmp_path / "one", *common(models, *flags))
    run_train("--task", "sft:data_process", "--dataset_base_path", data, "--dataset_metadata_path", meta,
              "--output_path", tmp_path / "cache", *common(models, *flags))
    run_train("--task", "sft:train", "--dataset_base_path", tmp_path / "cache", "--output_path", tmp_path / "two",
              *common(models, *flags))
    assert max_diff(tmp_path / "one" / "epoch-1.safetensors", tmp_path / "two" / "epoch-1.safetensors") <= 1e-5
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert "edit_image" in manifest["frontier"] and "prompt_embeds" not in manifest["frontier"]


def test_sample_command_takes_several_edit_images(tmp_path, repo, pipe, monkeypatch, capsys):
    import numpy as np
    from difftune.cli.main import main

    monkeypatch.setattr(edit_plus, "VAE_IMAGE_AREA", VAE_AREA)
    a, b = pictures()
    a.save(tmp_path / "a.png")
    b.save(tmp_path / "b.png")
    common = ["sample", "--model_dir", repo, "--prompt", "combine", "--height", 32, "--width", 32,
              "--num_inference_steps", 2, "--torch_dtype", "float32", "--seed", 1, "--edit_image", tmp_path / "a.png"]
    runs = {"two": ["--edit_image", tmp_path / "b.png"], "one_plus": ["--edit_plus"], "one": []}
    for name, more in runs.items():
        assert main([str(x) for x in [*common, *more, "--output", tmp_path / f"{name}.png"]]) == 0
    got = {name: np.asarray(Image.open(tmp_path / f"{name}.png"), dtype=np.int16) for name in runs}
    want = np.asarray(pipe("combine", edit_image=[a, b], height=32, width=32, num_inference_steps=2, seed=1,
                           progress=False), dtype=np.int16)
    assert np.abs(got["two"] - want).max() <= 1  # the pipeline called with the list of both images
    assert np.abs(got["one_plus"] - got["one"]).max() > 0  # --edit_plus: the multi-image template
    capsys.readouterr()
    assert main([str(x) for x in [*common[:-2], "--edit_plus", "--output", tmp_path / "x.png"]]) == 2
    assert "--edit_plus: it needs --edit_image" in capsys.readouterr().err
