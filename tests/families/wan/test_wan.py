"""Wan: sampling parity with diffusers' WanPipeline / WanImageToVideoPipeline (T2V, I2V 14B, the A14B expert
switch, TI2V-5B), the reference's timestep boundaries, split == one-stage for the variants, the TI2V first frame
left out of the loss, the reference's LoRA target names, and the saved LoRA in diffusers."""

import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from conftest import run_train
from difftune import WanVideoPipeline
from difftune.errors import UserError
from difftune.models import ModelConfig
from support import tiny_wan_paths, write_example_dataset, write_tiny_wan

KW = dict(height=32, width=48, num_frames=9, num_inference_steps=4)


@pytest.fixture(scope="module")
def repos(tmp_path_factory):
    root = tmp_path_factory.mktemp("wan")
    return {v: write_tiny_wan(root / v, v) for v in ("t2v", "i2v", "flf2v", "a14b", "i2v_a14b", "ti2v")}


def load_pipe(root, slots=None):
    paths = tiny_wan_paths(root)
    extra = {"image_processor_config": ModelConfig(str(root / "image_processor"))} \
        if (root / "image_processor").is_dir() else {}
    return WanVideoPipeline.from_pretrained(
        torch_dtype=torch.float32, model_configs=[ModelConfig(p[0]) for k, p in paths.items()
                                                  if slots is None or k in slots],
        tokenizer_config=ModelConfig(str(root / "tokenizer")), **extra)


def diffusers_pipe(root, i2v):
    import diffusers.pipelines.wan.pipeline_wan as t2v_module
    import diffusers.pipelines.wan.pipeline_wan_i2v as i2v_module
    from diffusers import WanImageToVideoPipeline, WanPipeline

    # diffusers 0.42's I2V module calls ftfy without checking it is installed (its T2V module checks)
    i2v_module.basic_clean = t2v_module.basic_clean
    pipe = (WanImageToVideoPipeline if i2v else WanPipeline).from_pretrained(str(root), torch_dtype=torch.float32)
    pipe.set_progress_bar_config(disable=True)
    return pipe


def image(width, height, seed=0):
    return Image.fromarray((np.random.RandomState(seed).rand(height, width, 3) * 255).astype("uint8"))


@pytest.mark.parametrize("variant", ["t2v", "i2v", "flf2v", "a14b", "i2v_a14b", "ti2v"])
def test_sampling_equals_diffusers(repos, variant):
    """Same seed (CPU generator), steps and guidance: the latents and the frames diffusers gives (FLF2V: with an
    end image)."""
    kw = dict(KW, width=64) if variant == "ti2v" else KW  # TI2V-5B: multiples of 32
    i2v = variant in ("i2v", "flf2v", "i2v_a14b", "ti2v")
    img = image(kw["width"], kw["height"])
    end = {"image": image(kw["width"], kw["height"], seed=1)} if variant == "flf2v" else {}
    theirs = diffusers_pipe(repos[variant], i2v)
    ours = load_pipe(repos[variant])
    assert type(ours.scheduler.sampler).__name__ == "UniPCMultistepScheduler"  # the repository's scheduler
    their_args = dict(prompt="a red fox", negative_prompt="blurry", guidance_scale=5.0, **kw,
                      **({"image": img} if i2v else {}), **({"last_image": end["image"]} if end else {}))
    our_args = dict(negative_prompt="blurry", cfg_scale=5.0, seed=3, progress=False, **kw,
                    **({"input_image": img} if i2v else {}), **({"end_image": end["image"]} if end else {}))
    a = theirs(generator=torch.Generator("cpu").manual_seed(3), output_type="latent", **their_args).frames
    b = ours("a red fox", output_type="latent", **our_args)
    diff = (a - b).abs().max().item()
    print(f"wan {variant}: latents max difference to diffusers {diff:.3e} (max |latent| {a.abs().max().item():.2f})")
    assert a.shape == b.shape and diff <= 1e-5
    frames = theirs(generator=torch.Generator("cpu").manual_seed(3), output_type="np", **their_args).frames[0]
    mine = ours("a red fox", **our_args)
    assert len(mine) == kw["num_frames"] and mine[0].size == (kw["width"], kw["height"])
    pixels = np.abs(np.round(frames * 255).astype(int) - np.stack([np.asarray(f) for f in mine]).astype(int)).max()
    print(f"wan {variant}: frames max uint8 difference to diffusers {pixels}")
    assert pixels <= 1


def test_a14b_switches_experts_at_the_boundary(repos):
    """Both experts take part (dropping the low-noise one changes the result); the switch follows the
    repository's boundary_ratio, and a boundary above every timestep uses the high-noise expert alone."""
    pipe = load_pipe(repos["a14b"])
    assert pipe.boundary_ratio == 0.875 and pipe.dit2 is not None
    args = dict(cfg_scale=5.0, seed=3, progress=False, output_type="latent", **KW)
    both = pipe("a red fox", **args)
    high_only = load_pipe(repos["a14b"], slots=("transformer", "text_encoder", "vae"))
    alone = high_only("a red fox", **args)
    assert (both - alone).abs().max().item() > 1e-3
    assert torch.equal(pipe("a red fox", boundary_ratio=0.0, **args), alone)  # every t >= 0: the high-noise one


def test_reference_target_names_are_diffusers_modules(repos):
    """q,k,v,o,ffn.0,ffn.2 (the reference's Wan names) reach the self- and cross-attention and FFN Linear layers."""
    from difftune.lora import inject_lora
    from difftune.training.module import lora_targets

    pipe = load_pipe(repos["t2v"], slots=("transformer",))
    targets = lora_targets(pipe, "dit", "q,k,v,o,ffn.0,ffn.2".split(","))
    assert targets == ["to_q", "to_k", "to_v", "to_out.0", "ffn.net.0.proj", "ffn.net.2"]
    inject_lora(pipe.dit, targets, 4, None)
    wrapped = sorted({n.split(".lora_A")[0].split("blocks.0.")[-1] for n, _ in pipe.dit.named_parameters()
                      if "blocks.0." in n and "lora_A" in n})
    assert wrapped == ["attn1.to_k", "attn1.to_out.0", "attn1.to_q", "attn1.to_v", "attn2.to_k", "attn2.to_out.0",
                       "attn2.to_q", "attn2.to_v", "ffn.net.0.proj", "ffn.net.2"]


def test_timestep_boundaries_draw_the_reference_range():
    """0.358 at shift 5 splits the table at t ~ 900: the high-noise expert trains on [900, 1000], the low on
    [0, 900); bad boundaries are one-line errors naming the flags."""
    from difftune.families.wan.scheduler import WanScheduler

    s = WanScheduler()
    g = torch.Generator().manual_seed(0)
    s.set_training(boundaries=(0.0, 0.358))
    high = torch.cat([s.sample_training(1, g)[1] for _ in range(500)])
    s.set_training(boundaries=(0.358, 1.0))
    low = torch.cat([s.sample_training(1, g)[1] for _ in range(500)])
    assert 900.0 <= high.min() and high.max() <= 1000.0 and low.max() < 900.0 and low.min() < 100.0
    with pytest.raises(UserError, match="--min_timestep_boundary 0.5 / --max_timestep_boundary 0.5"):
        s.set_training(boundaries=(0.5, 0.5))
    with pytest.raises(UserError, match="uniform"):
        s.set_training(boundaries=(0.0, 0.5), timestep_sampling="logit_normal")


# -- training --------------------------------------------------------------------------------------------------

def flags(paths, *more):
    return ["--family", "wan", "--model_paths", json.dumps(paths), "--torch_dtype", "float32", "--learning_rate",
            1e-3, "--dataset_repeat", 2, "--num_epochs", 1, "--seed", 5, "--no_progress", "--enable_tensorboard_log",
            "false", "--lora_base_model", "dit", "--lora_target_modules", "q,k,v,o,ffn.0,ffn.2", "--lora_rank", 4,
            *more]


def one_stage_and_split(root, meta, paths, *more, built=None, task="sft"):
    """Weights of one-stage and split training and their largest difference; `built` collects the slots the
    stage-2 run loads."""
    import difftune.models as models_pkg

    data = meta.parent
    run_train("--task", task, "--dataset_base_path", data, "--dataset_metadata_path", meta,
              "--output_path", root / "one", *flags(paths, *more))
    run_train("--task", f"{task}:data_process", "--dataset_base_path", data, "--dataset_metadata_path", meta,
              "--output_path", root / "cache", *flags(paths, *more))
    real = models_pkg.load_component
    models_pkg.load_component = lambda config, *a, **k: (built.append(real(config, *a, **k)) or built[-1]) \
        if built is not None else real(config, *a, **k)
    try:
        run_train("--task", f"{task}:train", "--dataset_base_path", root / "cache", "--output_path", root / "two",
                  *flags(paths, *more))
    finally:
        models_pkg.load_component = real
    a, b = load_file(str(root / "one" / "epoch-0.safetensors")), load_file(str(root / "two" / "epoch-0.safetensors"))
    assert a.keys() == b.keys() and a
    return a, max((a[k] - b[k]).abs().max().item() for k in a)


def with_input_image(meta):
    """The metadata with an input_image column (the clip's first frame: here the still itself)."""
    lines = meta.read_text().splitlines()
    rows = [lines[0] + ",input_image"] + [f"{ln},{ln.split(',')[0]}" for ln in lines[1:]]
    meta.write_text("\n".join(rows) + "\n")
    return meta


def test_i2v_lora_split_equals_one_stage(repos, tmp_path):
    meta = with_input_image(write_example_dataset(tmp_path / "data", n=2, size=(48, 32)))
    paths = [p[0] for p in tiny_wan_paths(repos["i2v"]).values()]
    built = []
    _, diff = one_stage_and_split(tmp_path, meta, paths, "--extra_inputs", "input_image", built=built)
    print(f"wan i2v LoRA: split vs one-stage max difference {diff:.2e}")
    assert diff <= 1e-5
    assert [c.name for c in built] == ["dit"]  # stage 2 builds neither UMT5, the VAE nor CLIP


def test_a14b_expert_with_boundaries_split_equals_one_stage(repos, tmp_path):
    """The reference's Wan2.2-I2V-A14B high-noise expert run: its DiT only, --extra_inputs input_image,
    --max_timestep_boundary 0.358 --min_timestep_boundary 0."""
    meta = with_input_image(write_example_dataset(tmp_path / "data", n=2, size=(48, 32)))
    paths = tiny_wan_paths(repos["i2v_a14b"])
    paths = [paths[k][0] for k in ("transformer", "text_encoder", "vae")]
    image_flags = ("--extra_inputs", "input_image")
    a, diff = one_stage_and_split(tmp_path, meta, paths, *image_flags, "--max_timestep_boundary", 0.358,
                                  "--min_timestep_boundary", 0)
    print(f"wan i2v-a14b high-noise expert LoRA: split vs one-stage max difference {diff:.2e}")
    assert diff <= 1e-5
    # the boundaries are in effect: the other expert's range trains other weights
    run_train("--task", "sft", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
              "--output_path", tmp_path / "low", *flags(paths, *image_flags, "--min_timestep_boundary", 0.358))
    low = load_file(str(tmp_path / "low" / "epoch-0.safetensors"))
    assert max((a[k] - low[k]).abs().max().item() for k in a) > 1e-6


def test_direct_distill_split_equals_one_stage(repos, tmp_path):
    """The reference's direct distillation (sampling from the seeded noise with gradients through the steps)."""
    meta = write_example_dataset(tmp_path / "data", n=2, size=(48, 32))
    rows = [{"image": f"image_{i + 1}.png", "prompt": p, "seed": 10 + i, "num_inference_steps": 2}
            for i, p in enumerate(["a fox", "a cat"])]
    (meta.parent / "metadata.json").write_text(json.dumps(rows))
    paths = [p[0] for p in tiny_wan_paths(repos["t2v"]).values()]
    a, diff = one_stage_and_split(tmp_path, meta.parent / "metadata.json", paths, task="direct_distill")
    assert any(v.abs().max() > 0 for k, v in a.items() if ".lora_B." in k)  # it trained
    print(f"wan direct_distill LoRA: split vs one-stage max difference {diff:.2e}")
    assert diff <= 1e-5


def test_ti2v_split_equals_one_stage(repos, tmp_path):
    """TI2V-5B on 5-frame mp4 clips, input_image = each clip's first frame (--extra_inputs, no such column)."""
    from support import write_example_video_dataset

    meta = write_example_video_dataset(tmp_path / "data", n=2, num_frames=5, size=(64, 32))
    paths = [p[0] for p in tiny_wan_paths(repos["ti2v"]).values()]
    _, diff = one_stage_and_split(tmp_path, meta, paths, "--num_frames", 5, "--extra_inputs", "input_image")
    print(f"wan ti2v LoRA (5-frame clips): split vs one-stage max difference {diff:.2e}")
    assert diff <= 1e-5


def test_ti2v_first_frame_is_clean_and_out_of_the_loss(repos):
    """TI2V-5B with an input image: the DiT sees the image's latents as the first latent frame at timestep 0,
    and the loss is the MSE over the other frames only (the first frame's prediction does not count)."""
    from difftune.training.losses import flow_match_sft_loss, sample_generator

    pipe = load_pipe(repos["ti2v"])
    pipe.scheduler.set_training()
    still = image(64, 32)
    frames = [Image.fromarray(np.roll(np.asarray(still), 2 * k, axis=1)) for k in range(5)]
    values = pipe.training_inputs({"video": frames, "input_image": frames[0], "prompt": "a fox"})
    pipe.run_units(values)
    x0, first = values["input_latents"], values["first_frame_latents"]
    assert x0.shape[2] == 2 and first.shape[2] == 1
    seen = {}
    real = pipe.dit.forward

    def spy(hidden_states, timestep, **kw):
        seen["x"], seen["t"] = hidden_states.clone(), timestep.clone()
        out = real(hidden_states, timestep, **kw)
        seen["out"] = out[0]
        return (out[0] + seen.get("bump", 0.0),) + tuple(out[1:])

    pipe.dit.forward = spy
    loss = flow_match_sft_loss(pipe, values, [sample_generator(0, 0, 0)], {})
    assert torch.equal(seen["x"][:, :, :1], first)  # the clean first frame in the DiT's input
    tokens = (x0.shape[3] // 2) * (x0.shape[4] // 2)
    assert torch.all(seen["t"][0, :tokens] == 0) and torch.all(seen["t"][0, tokens:] > 0)
    # the loss by hand: MSE over frames 1: only, times the bell weight of the drawn timestep
    g = sample_generator(0, 0, 0)  # the loss's draws, in its order: timestep, then noise
    _, _, weight = pipe.scheduler.sample_training(1, g)
    noise = torch.randn(x0.shape[1:], generator=g)[None]
    target = noise - x0
    want = ((seen["out"][:, :, 1:] - target[:, :, 1:]) ** 2).mean() * weight
    assert torch.allclose(loss, want, rtol=1e-5, atol=0)
    seen["bump"] = torch.zeros_like(seen["out"])
    seen["bump"][:, :, :1] = 100.0  # whatever the first frame's prediction, the loss is the same
    assert torch.allclose(flow_match_sft_loss(pipe, values, [sample_generator(0, 0, 0)], {}), loss, rtol=1e-6)


def test_saved_lora_loads_in_diffusers(repos, tmp_path):
    """The LoRA difftune saves (the reference's Wan target names) loads with WanPipeline.load_lora_weights, every
    tensor used, changes the output, and gives the video difftune gives with the LoRA fused."""
    from diffusers import WanPipeline
    from peft.utils import get_peft_model_state_dict

    meta = write_example_dataset(tmp_path / "data", n=2, size=(48, 32))
    paths = [p[0] for p in tiny_wan_paths(repos["t2v"]).values()]
    run_train("--task", "sft", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
              "--output_path", tmp_path / "out", *flags(paths, "--learning_rate", 5e-2, "--lora_format", "diffusers"))
    lora = tmp_path / "out" / "epoch-0.safetensors"
    saved = load_file(str(lora))
    theirs = WanPipeline.from_pretrained(str(repos["t2v"]), torch_dtype=torch.float32)
    theirs.set_progress_bar_config(disable=True)
    args = dict(prompt="a red circle", guidance_scale=5.0, output_type="latent", **KW)
    base = theirs(generator=torch.Generator().manual_seed(0), **args).frames
    theirs.load_lora_weights(str(lora), adapter_name="t")
    loaded = get_peft_model_state_dict(theirs.transformer, adapter_name="t")
    weights = {k: v for k, v in saved.items() if k.endswith(".weight")}
    assert {f"transformer.{k}" for k in loaded} == set(weights)
    assert all(torch.equal(loaded[k[len("transformer."):]], v) for k, v in weights.items())
    with_lora = theirs(generator=torch.Generator().manual_seed(0), **args).frames
    assert (with_lora - base).abs().max().item() > 1e-3
    ours = load_pipe(repos["t2v"])
    ours.load_lora(ours.dit, str(lora))
    mine = ours("a red circle", cfg_scale=5.0, seed=0, progress=False, output_type="latent", **KW)
    diff = (mine - with_lora).abs().max().item()
    print(f"wan LoRA in diffusers vs difftune fused: latents max difference {diff:.3e}")
    assert diff <= 1e-4


def test_training_inputs_refuse_bad_clips(repos):
    pipe = WanVideoPipeline()
    with pytest.raises(UserError, match="row 4: the clip has 4 frames; Wan needs 4k\\+1"):
        pipe.training_inputs({"_row": 3, "video": [image(16, 16)] * 4, "prompt": "x"})
    with pytest.raises(UserError, match="row 3: no clip"):
        pipe.training_inputs({"_row": 2, "prompt": "x"})


def test_sample_command_writes_the_clip(repos, tmp_path):
    """`difftune sample` on a Wan repository writes the pipeline's clip (here an animated GIF: 5 frames)."""
    from difftune.cli.sample import main

    out = tmp_path / "clip.gif"
    assert main(["--model_dir", str(repos["t2v"]), "--prompt", "a red fox", "--torch_dtype", "float32",
                 "--height", "32", "--width", "48", "--num_frames", "5", "--num_inference_steps", "2",
                 "--seed", "1", "--device", "cpu", "--output", str(out)]) == 0
    clip = Image.open(out)
    assert clip.n_frames == 5 and clip.size == (48, 32)
    with pytest.raises(UserError, match="--num_frames 4: the wan family takes 4k\\+1 frames"):
        main(["--model_dir", str(repos["t2v"]), "--prompt", "x", "--num_frames", "4", "--output", str(out)])


@pytest.mark.parametrize("flags_,message", [
    (("--max_timestep_boundary", "1.5"), "error: --max_timestep_boundary 1.5: must be in (0, 1]"),
    (("--min_timestep_boundary", "0.5", "--max_timestep_boundary", "0.358"),
     "error: --min_timestep_boundary 0.5: must be in [0, --max_timestep_boundary 0.358)")])
def test_bad_timestep_boundaries_are_refused_before_any_work(repos, tmp_path, capsys, flags_, message):
    from difftune.cli.main import main as cli

    meta = write_example_dataset(tmp_path / "data", n=1, size=(48, 32))
    paths = [p[0] for p in tiny_wan_paths(repos["t2v"]).values()]
    code = cli(["train", "--dataset_base_path", str(meta.parent), "--dataset_metadata_path", str(meta),
                "--output_path", str(tmp_path / "out"), *[str(f) for f in flags(paths)], *flags_])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and err[0].startswith(message), err
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").glob("*.safetensors"))


def test_expert_lora_fuses_into_the_low_noise_expert(repos, tmp_path):
    """A LoRA trained with transformer_2/ as `dit` (the low-noise run) fuses into `dit2` of the pair."""
    from safetensors.torch import save_file

    pipe = load_pipe(repos["a14b"])
    before = {k: v.clone() for k, v in pipe.dit2.state_dict().items()}
    a, b = torch.randn(4, 16), torch.randn(16, 4)
    path = tmp_path / "low.safetensors"
    save_file({"transformer.blocks.0.attn1.to_q.lora_A.weight": a,
               "transformer.blocks.0.attn1.to_q.lora_B.weight": b}, str(path))
    pipe.load_lora(pipe.dit2, str(path), alpha=0.5)
    after = pipe.dit2.state_dict()
    key = "blocks.0.attn1.to_q.weight"
    assert torch.allclose(after[key], before[key] + 0.5 * b @ a, atol=1e-6)
    assert all(torch.equal(after[k], before[k]) for k in before if k != key)


def test_validation_renders_frames_during_training(repos, tmp_path, capsys):
    """T2V: validation renders the first frame of a clip per prompt into the grid; I2V: each prompt renders with the
    input image of the training sample of its index (at that sample's size), and training goes on."""
    meta = write_example_dataset(tmp_path / "data", n=1, size=(48, 32))
    common = ["--task", "sft", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
              "--validation_prompts", "a fox|a cat", "--validation_steps", 1, "--validation_size", 32,
              "--validation_inference_steps", 2, "--max_steps", 1]
    paths = [p[0] for p in tiny_wan_paths(repos["t2v"]).values()]
    run_train(*common, "--output_path", tmp_path / "t2v", *flags(paths))
    grids = sorted((tmp_path / "t2v").rglob("step-*.png"))
    assert len(grids) == 1 and Image.open(grids[0]).size[0] >= 64  # two 32 px frames side by side
    meta = with_input_image(meta)
    paths = [p[0] for p in tiny_wan_paths(repos["i2v"]).values()]
    run_train(*common, "--output_path", tmp_path / "i2v", "--extra_inputs", "input_image", *flags(paths))
    assert "validation renders each prompt with the conditioning of the training sample" in capsys.readouterr().out
    grids = sorted((tmp_path / "i2v").rglob("step-*.png"))
    assert len(grids) == 1 and Image.open(grids[0]).size == (48, 2 * 32)  # a 48x32 frame per prompt, in rows
    assert any((tmp_path / "i2v").glob("*.safetensors"))  # the run finished and saved


def test_comfyui_and_kohya_layouts_use_wan_original_names(repos, tmp_path):
    """--lora_format comfyui / kohya write Wan's original module names (ComfyUI's and musubi-tuner's keys), with
    alpha; such files load back (pipe.load_lora) to the same weights as the diffusers-layout file."""
    meta = write_example_dataset(tmp_path / "data", n=1, size=(48, 32))
    paths = [p[0] for p in tiny_wan_paths(repos["t2v"]).values()]
    files = {}
    for layout in ("diffusers", "comfyui", "kohya"):
        run_train("--task", "sft", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
                  "--output_path", tmp_path / layout, "--lora_format", layout, *flags(paths, "--learning_rate", 5e-2))
        files[layout] = tmp_path / layout / "epoch-0.safetensors"
    comfy, kohya = load_file(str(files["comfyui"])), load_file(str(files["kohya"]))
    assert "diffusion_model.blocks.0.self_attn.q.lora_A.weight" in comfy
    assert "diffusion_model.blocks.1.cross_attn.o.alpha" in comfy
    assert "diffusion_model.blocks.0.ffn.2.lora_B.weight" in comfy
    assert "lora_unet_blocks_0_self_attn_q.lora_down.weight" in kohya and "lora_unet_blocks_1_ffn_0.alpha" in kohya
    assert not any("attn1" in k or "to_q" in k for k in [*comfy, *kohya])
    fused = {}
    for layout, path in files.items():
        pipe = load_pipe(repos["t2v"], slots=("transformer",))
        pipe.load_lora(pipe.dit, str(path))
        fused[layout] = pipe.dit.state_dict()
    base = load_pipe(repos["t2v"], slots=("transformer",)).dit.state_dict()
    assert any(not torch.equal(fused["diffusers"][k], base[k]) for k in base)
    for layout in ("comfyui", "kohya"):
        assert max((fused[layout][k] - fused["diffusers"][k]).abs().max().item() for k in base) <= 1e-6, layout


def test_comfyui_layout_refuses_a_module_without_an_original_name_before_training(repos, tmp_path):
    meta = write_example_dataset(tmp_path / "data", n=1, size=(48, 32))
    paths = [p[0] for p in tiny_wan_paths(repos["t2v"]).values()]
    with pytest.raises(UserError, match="LoRA on proj_out: the ComfyUI / kohya layouts name"):
        run_train("--task", "sft", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
                  "--output_path", tmp_path / "out", "--lora_format", "comfyui",
                  *flags(paths)[:-4], "--lora_target_modules", "proj_out", "--lora_rank", 4)
    assert not any((tmp_path / "out").glob("*.safetensors"))


def test_latent_layout_follows_the_vae(repos):
    """Wan2.1 VAE: 16 channels, x8; Wan2.2 (TI2V-5B): 48 channels, x16; 4k+1 frames -> k+1 latent frames.
    `decode` gives clips (B, 3, F, H, W), a one-frame clip as images."""
    t2v = load_pipe(repos["t2v"], slots=("vae",))
    assert t2v.stream.noise_shape(t2v, 32, 48, num_frames=9) == (16, 3, 4, 6) and \
        t2v.stream.noise_shape(t2v, 32, 48) == (16, 1, 4, 6)
    ti2v = load_pipe(repos["ti2v"], slots=("vae",))
    assert ti2v.stream.noise_shape(ti2v, 32, 64, num_frames=5) == (48, 2, 2, 4)
    assert t2v.decode(torch.zeros(1, 16, 3, 4, 6)).shape == (1, 3, 9, 32, 48)
    assert t2v.decode(torch.zeros(2, 16, 1, 4, 6)).shape == (2, 3, 32, 48)


# -- Wan-AI's original layout ----------------------------------------------------------------------------------

@pytest.fixture()
def original(tmp_path, monkeypatch):
    """A tiny I2V-A14B repository in Wan-AI's original layout, its diffusers twin, and the tiny configs as known
    ones (recognition matches bare weights against the official configs, which tiny models are not)."""
    from difftune.families.wan.components import DIT_ORIGINAL, TEXT_ENCODER_ORIGINAL, VAE_ORIGINAL
    from support import write_tiny_wan_original

    root, reference = write_tiny_wan_original(tmp_path / "Wan2.2-I2V-A14B", "i2v_a14b")
    for spec, folder in ((DIT_ORIGINAL, "transformer"), (TEXT_ENCODER_ORIGINAL, "text_encoder"),
                         (VAE_ORIGINAL, "vae")):
        monkeypatch.setitem(spec.known_configs, "tiny", json.loads((reference / folder / "config.json").read_text()))
    return root, reference


def test_original_files_load_as_the_diffusers_layout(original):
    """diffusion_pytorch_model.safetensors (Wan's names, Wan's own config.json beside it), the .pth T5 and VAE:
    recognised from their tensors and loaded to exactly the diffusers-layout tensors; both experts in order."""
    from difftune.core.family import recognise
    from difftune.models import load_component

    root, reference = original
    files = [root / "high_noise_model" / "diffusion_pytorch_model.safetensors",
             root / "low_noise_model" / "diffusion_pytorch_model.safetensors",
             root / "models_t5_umt5-xxl-enc-bf16.pth", root / "Wan2.1_VAE.pth"]
    spec, found = recognise([ModelConfig(str(f)) for f in files], None, log=lambda *a: None)
    assert spec.name == "wan" and [slot for slot, _, _ in found] == ["dit", "dit2", "text_encoder", "vae"]
    twins = dict(zip(["dit", "dit2", "text_encoder", "vae"], ["transformer", "transformer_2", "text_encoder", "vae"]))
    for slot, config, det in found:
        mine = load_component(config, spec.components, torch_dtype=torch.float32).module.state_dict()
        want_file = tiny_wan_paths(reference)[twins[slot]][0]
        want = load_component(ModelConfig(want_file), spec.components, torch_dtype=torch.float32).module.state_dict()
        assert mine.keys() == want.keys() and all(torch.equal(mine[k], want[k]) for k in want), slot


@pytest.mark.parametrize("variant", ["i2v", "ti2v"])
def test_original_clip_and_wan22_vae_load_as_the_diffusers_layout(variant, tmp_path, monkeypatch):
    """The CLIP .pth (open-clip names, text tower dropped) and Wan2.2_VAE.pth are recognised from their tensors
    and load to exactly the diffusers layout's tensors (the CLIP's projection head is the file's own)."""
    from difftune.core.family import recognise
    from difftune.families.wan.components import (DIT_ORIGINAL, IMAGE_ENCODER_ORIGINAL, TEXT_ENCODER_ORIGINAL,
                                                  VAE22_ORIGINAL, VAE_ORIGINAL)
    from difftune.models import load_component
    from support import write_tiny_wan_original

    root, reference = write_tiny_wan_original(tmp_path / variant, variant)
    vae_spec = VAE22_ORIGINAL if variant == "ti2v" else VAE_ORIGINAL
    for spec, folder in ((DIT_ORIGINAL, "transformer"), (TEXT_ENCODER_ORIGINAL, "text_encoder"), (vae_spec, "vae"),
                         (IMAGE_ENCODER_ORIGINAL, "image_encoder")):
        if (reference / folder).is_dir():
            monkeypatch.setitem(spec.known_configs, "tiny",
                                json.loads((reference / folder / "config.json").read_text()))
    files = {"dit": root / "diffusion_pytorch_model.safetensors",
             "text_encoder": root / "models_t5_umt5-xxl-enc-bf16.pth",
             "vae": root / ("Wan2.2_VAE.pth" if variant == "ti2v" else "Wan2.1_VAE.pth")}
    if variant == "i2v":
        files["image_encoder"] = root / "models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth"
    spec, found = recognise([ModelConfig(str(f)) for f in files.values()], None, log=lambda *a: None)
    assert spec.name == "wan" and [slot for slot, _, _ in found] == list(files)
    twins = {"dit": "transformer", "text_encoder": "text_encoder", "vae": "vae", "image_encoder": "image_encoder"}
    for slot, config, det in found:
        mine = load_component(config, spec.components, torch_dtype=torch.float32).module
        want = load_component(ModelConfig(tiny_wan_paths(reference)[twins[slot]][0]), spec.components,
                              torch_dtype=torch.float32).module.state_dict()
        got = mine.state_dict()
        if slot == "image_encoder":
            assert type(mine).__name__ == "CLIPVisionModelWithProjection"
            assert got["visual_projection.weight"].shape == (32, 32)
            got = {k.removeprefix("vision_model."): v for k, v in got.items() if k != "visual_projection.weight"}
        if slot == "vae" and variant == "ti2v":
            assert mine.config.z_dim == 48 and mine.config.is_residual
        assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want), slot


def test_official_clip_processor_squashes_to_the_encoder_size():
    """Without an image_processor/ folder (the original .pth) the CLIP input is the whole image resized to the
    encoder's size, bicubic, normalised with CLIP's mean / std (Wan's own preprocessing)."""
    from types import SimpleNamespace

    from PIL import Image

    from difftune.families.wan.units import official_clip_processor

    processor = official_clip_processor(SimpleNamespace(config=SimpleNamespace(image_size=224)))
    pixels = processor(images=[Image.new("RGB", (832, 480), (255, 0, 0))], return_tensors="pt").pixel_values
    assert pixels.shape == (1, 3, 224, 224)
    want = torch.tensor([(1 - 0.48145466) / 0.26862954, -0.4578275 / 0.26130258, -0.40821073 / 0.27577711])
    assert torch.allclose(pixels[0, :, 100, 100], want, atol=1e-5)


def test_reference_a14b_command_on_original_files(original, tmp_path):
    """The reference's Wan2.2-I2V-A14B high-noise run, its files named as its script names them, trains the same
    LoRA as the same run on the diffusers layout: the same losses up to float round-off (the two layouts' files load
    through different conversions; one CI machine differed in a loss's last digit), and weights equal up to float
    round-off (the models' tensors are equal; Adam magnifies round-off where a gradient is near zero, the
    cross-attention's to_k here)."""
    root, reference = original
    meta = with_input_image(write_example_dataset(tmp_path / "data", n=1, size=(48, 32)))
    run = ["--task", "sft", "--dataset_base_path", meta.parent, "--dataset_metadata_path", meta,
           "--extra_inputs", "input_image", "--max_timestep_boundary", 0.358, "--min_timestep_boundary", 0,
           "--remove_prefix_in_ckpt", "pipe.dit.", "--enable_csv_log"]
    files = [str(root / "high_noise_model" / "diffusion_pytorch_model.safetensors"),
             str(root / "models_t5_umt5-xxl-enc-bf16.pth"), str(root / "Wan2.1_VAE.pth")]
    run_train(*run, "--output_path", tmp_path / "orig", "--tokenizer_path", root / "google" / "umt5-xxl",
              *flags(files))
    twin = tiny_wan_paths(reference)
    run_train(*run, "--output_path", tmp_path / "diff",
              *flags([twin[k][0] for k in ("transformer", "text_encoder", "vae")]))
    a = load_file(str(tmp_path / "orig" / "epoch-0.safetensors"))
    b = load_file(str(tmp_path / "diff" / "epoch-0.safetensors"))
    losses = [[row.split(",") for row in (tmp_path / run / "loss.csv").read_text().split()] for run in ("orig", "diff")]
    assert [r[:2] + r[3:] for r in losses[0]] == [r[:2] + r[3:] for r in losses[1]] and len(losses[0]) == 3
    assert [float(r[2]) for r in losses[0][1:]] == pytest.approx([float(r[2]) for r in losses[1][1:]], rel=1e-6)
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"wan original layout vs diffusers layout, I2V-A14B expert LoRA: max difference {diff:.2e}")
    assert a.keys() == b.keys() and a and diff <= 1e-4


def test_hub_ids_with_the_repository_scheduler(repos, tmp_path, monkeypatch):
    """From hub ids (an offline hub): both A14B experts in order, the tokenizer, and the repository's scheduler/
    with model_index.json's boundary_ratio; the video equals the one from local paths."""
    from support import populate_offline_hub

    repo = "Wan-AI/Wan2.2-T2V-A14B-Diffusers"
    populate_offline_hub(tmp_path / "models", repo, repos["a14b"])
    monkeypatch.setenv("DIFFTUNE_MODEL_BASE_PATH", str(tmp_path / "models"))
    monkeypatch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "true")
    pipe = WanVideoPipeline.from_pretrained(
        torch_dtype=torch.float32,
        model_configs=[ModelConfig(model_id=repo, origin_file_pattern=f"{folder}/*.safetensors")
                       for folder in ("transformer", "transformer_2", "text_encoder", "vae")],
        tokenizer_config=ModelConfig(model_id=repo, origin_file_pattern="tokenizer/"),
        repo_scheduler_config=ModelConfig(model_id=repo, origin_file_pattern="scheduler/"))
    assert type(pipe.scheduler.sampler).__name__ == "UniPCMultistepScheduler" and pipe.boundary_ratio == 0.875
    args = dict(cfg_scale=5.0, seed=3, progress=False, output_type="latent", **KW)
    assert torch.equal(pipe("a red fox", **args), load_pipe(repos["a14b"])("a red fox", **args))
