"""Ideogram-4: recognition of every layout (the repackage's original names, a diffusers transformer folder, the
conditional then the unconditional DiT), the training schedule against the reference's formula, `difftune sample`,
`--full_format original`, and the unconditional side of guidance reading no prompt."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from conftest import run_train
from difftune.cli.sample import main as sample
from difftune.families.ideogram4.components import convert_original_dit, original_dit_keys
from difftune.families.ideogram4.scheduler import Ideogram4Scheduler
from support import write_example_dataset
from support.ideogram4 import REPACKAGE, TOKENIZER_REPO, hub_paths, load_tiny_ideogram4, tiny_dit, \
    write_tiny_ideogram4_hub

SIZE = ["--height", "32", "--width", "48", "--num_inference_steps", "2", "--torch_dtype", "float32", "--seed", "3",
        "--device", "cpu"]


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return write_tiny_ideogram4_hub(tmp_path_factory.mktemp("ideogram4_hub"))


def test_original_names_convert_both_ways():
    state = tiny_dit().state_dict()
    original = original_dit_keys(state)
    assert "layers.0.attention.qkv.weight" in original and "layers.1.attention.o.weight" in original
    assert not any("to_q" in k or "to_out" in k for k in original)
    back = convert_original_dit(original)
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


def test_the_repackage_and_a_diffusers_folder_are_recognised(hub, tmp_path):
    pipe = load_tiny_ideogram4(hub)  # original names, bare files: the DiT given first is the conditional one
    released = load_file(str(hub / REPACKAGE / "transformer" / "diffusion_pytorch_model.safetensors"))
    uncond = load_file(str(hub / REPACKAGE / "unconditional_transformer" / "diffusion_pytorch_model.safetensors"))
    assert torch.equal(pipe.dit.state_dict()["layers.0.attention.to_k.weight"],
                       released["layers.0.attention.qkv.weight"].chunk(3)[1])
    assert torch.equal(pipe.dit_uncond.state_dict()["input_proj.weight"], uncond["input_proj.weight"])
    assert pipe.dit.config.mrope_section == [2, 1, 1]
    # diffusers' own transformer/ folder (config.json beside the weights)
    tiny_dit(seed=0).save_pretrained(tmp_path / "transformer")
    from difftune.families.ideogram4.pipeline import Ideogram4Pipeline
    from difftune.models import ModelConfig

    other = Ideogram4Pipeline.from_pretrained(torch_dtype=torch.float32,
                                              model_configs=[ModelConfig(str(tmp_path / "transformer"))])
    assert all(torch.equal(v, pipe.dit.state_dict()[k]) for k, v in other.dit.state_dict().items())


def test_the_training_table_is_the_references():
    """The reference's `set_timesteps_ideogram4(1000, image_resolution=(1024, 1024))`, written out: its sigmas and
    the bell weights over them (mean 1)."""
    sched = Ideogram4Scheduler()
    sched.set_training()
    sigmas, timesteps, weights = sched.training_table(sched.training_mu())
    mean = 0.5 * math.log(1024 * 1024 / (512 * 512))
    t_min, t_max = 1 / (1 + math.exp(9.0)), 1 / (1 + math.exp(-7.5))
    ref = []
    for s in torch.linspace(0.0, 1.0, 1001, dtype=torch.float64):
        t = 1 - torch.special.expit(mean + 1.5 * torch.special.ndtri(s))
        ref.append(float(t.clamp(t_min, t_max).to(torch.float32)))
    ref = (1 - torch.tensor(ref, dtype=torch.float32).flip(0))[:-1]
    assert len(sigmas) == 1000 and (sigmas - ref).abs().max() < 1e-6
    assert torch.allclose(timesteps, sigmas * 1000) and abs(weights.mean().item() - 1) < 1e-5
    assert sigmas[0] > 0.999 and sigmas[-1] < 0.1  # from noise down
    # dynamic shifting: the sample's own size moves the mean
    sched.set_training(shift="dynamic")
    small = sched.training_table(sched.training_mu(image_seq_len=4))[0]
    assert (small < sigmas).float().mean() > 0.9


def _same(path, image) -> bool:
    with Image.open(path) as written:
        return np.array_equal(np.asarray(written.convert("RGB")), np.asarray(image))


def test_difftune_sample(hub, tmp_path):
    tok = str(hub / TOKENIZER_REPO / "tokenizer")
    args = ["--model_paths", json.dumps(hub_paths(hub, uncond=True)), "--tokenizer_path", tok, "--prompt",
            "a red circle", *SIZE]
    assert sample([*args, "--output", str(tmp_path / "a.png"), "--cfg_scale", "3"]) == 0
    ours = load_tiny_ideogram4(hub)("a red circle", seed=3, height=32, width=48, num_inference_steps=2, cfg_scale=3.0,
                                    progress=False)
    assert ours.size == (48, 32) and _same(tmp_path / "a.png", ours)


def test_full_format_original_writes_the_repackage_names(hub, tmp_path):
    meta = write_example_dataset(tmp_path / "data", n=1, size=(32, 32))
    run_train("--task", "sft", "--dataset_base_path", tmp_path / "data", "--dataset_metadata_path", meta,
              "--output_path", tmp_path / "out", "--model_paths", json.dumps(hub_paths(hub)), "--tokenizer_path",
              str(hub / TOKENIZER_REPO / "tokenizer"), "--torch_dtype", "float32", "--learning_rate", 1e-3,
              "--max_steps", 1, "--no_progress", "--enable_tensorboard_log", "false", "--trainable_models", "dit",
              "--remove_prefix_in_ckpt", "pipe.dit.", "--full_format", "original")
    saved = load_file(str(next((tmp_path / "out").glob("*.safetensors"))))
    released = load_file(str(hub / REPACKAGE / "transformer" / "diffusion_pytorch_model.safetensors"))
    assert saved.keys() == released.keys()
    assert not torch.equal(saved["layers.0.attention.qkv.weight"], released["layers.0.attention.qkv.weight"])


def test_the_unconditional_side_reads_no_prompt(hub):
    """A negative prompt changes nothing: the unconditional pass has no text (Ideogram's asymmetric guidance)."""
    pipe = load_tiny_ideogram4(hub)
    kw = dict(seed=1, height=32, width=32, num_inference_steps=2, cfg_scale=5.0, output_type="latent", progress=False)
    assert torch.equal(pipe("a cat", negative_prompt="", **kw), pipe("a cat", negative_prompt="blurry, dark", **kw))
    assert not torch.equal(pipe("a cat", **kw), pipe("a dog", **kw))


def test_image_to_image_starts_from_the_noised_image(hub):
    """denoising_strength < 1 runs every step over the first `strength` of the schedule's quantiles (the reference's
    img2img), from the input image's latents noised to its first sigma."""
    pipe = load_tiny_ideogram4(hub)
    image = Image.fromarray((np.random.default_rng(0).random((32, 32, 3)) * 255).astype(np.uint8))
    kw = dict(seed=2, height=32, width=32, num_inference_steps=3, output_type="latent", progress=False)
    full = pipe("a cat", **kw)
    half = pipe("a cat", input_image=image, denoising_strength=0.5, **kw)
    assert pipe.scheduler.sigmas[0] < 0.99 and len(pipe.scheduler.timesteps) == 3
    assert not torch.allclose(full, half)
    near = pipe("a cat", input_image=image, denoising_strength=0.05, **kw)
    from difftune.families.ideogram4.units import vae_encode
    from difftune.media.image import images_to_tensor

    clean = vae_encode(pipe, images_to_tensor(image, 32, 32))
    assert (near - clean).abs().mean() < (half - clean).abs().mean()


def test_validation_during_training_with_both_dits(hub, tmp_path):
    """A LoRA run given the DiT and the unconditional DiT renders its validation prompts (guided through the latter)."""
    meta = write_example_dataset(tmp_path / "data", n=2, size=(32, 32))
    run_train("--task", "sft", "--dataset_base_path", tmp_path / "data", "--dataset_metadata_path", meta,
              "--output_path", tmp_path / "out", "--model_paths", json.dumps(hub_paths(hub, uncond=True)),
              "--tokenizer_path", str(hub / TOKENIZER_REPO / "tokenizer"), "--torch_dtype", "float32",
              "--max_steps", 2, "--no_progress", "--enable_tensorboard_log", "false", "--lora_base_model", "dit",
              "--lora_target_modules", "attention.qkv,attention.o", "--validation_prompts", json.dumps(["a cat"]),
              "--validation_steps", 1, "--height", 32, "--width", 32)
    renders = sorted((tmp_path / "out" / "validation").glob("step-*.png"))
    assert len(renders) == 2 and Image.open(renders[0]).size[0] >= 32


def test_training_the_unconditional_dit_is_refused_in_one_line(tmp_path, capsys):
    """The loss runs the conditional DiT only (as the reference's): a LoRA on `dit_uncond` would train nothing."""
    from difftune.cli.main import main as difftune
    from support import tiny_family

    t = tiny_family("ideogram4", tmp_path)
    meta = t.write_dataset(tmp_path / "data")
    code = difftune(["train", "--dataset_base_path", str(meta.parent), "--dataset_metadata_path", str(meta),
                     "--model_paths", json.dumps(t.model_paths), "--output_path", str(tmp_path / "out"),
                     "--lora_base_model", "dit_uncond", "--lora_target_modules", "to_q", "--max_steps", "1",
                     "--no_progress", *map(str, t.flags)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    assert "--lora_base_model dit_uncond" in err[0] and "change nothing" in err[0], err
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.safetensors"))
