"""The train command: the reference's command lines, learning, saving, interoperability, bad input."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import LORA_TARGETS, make_image_dataset, model_paths_json, run_train
from difftune.errors import UserError
from difftune.models import ModelConfig
from support import tiny_qwen_image_paths


def load_pipe(repo):
    from difftune.families.qwen_image import QwenImagePipeline

    paths = tiny_qwen_image_paths(repo)
    return QwenImagePipeline.from_pretrained(
        torch_dtype=torch.float32, model_configs=[ModelConfig(paths["transformer"]), ModelConfig(paths["text_encoder"]),
                                                  ModelConfig(paths["vae"][0])],
        tokenizer_config=ModelConfig(str(repo / "tokenizer")))


def eval_loss(pipe, meta_dir, n_draws=8):
    """The sft loss on fixed noise and timesteps for both images."""
    from difftune.data import UnifiedDataset
    from difftune.training.losses import flow_match_sft_loss, sample_generator
    from difftune.core.batch import collate_values, split_batch

    pipe.scheduler.set_training()
    ds = UnifiedDataset(str(meta_dir), str(meta_dir / "metadata.csv"), data_file_keys="image",
                        main_data_operator=UnifiedDataset.default_image_operator(str(meta_dir), max_pixels=4096))
    total = 0.0
    with torch.no_grad():
        for i in range(len(ds)):
            values = pipe.run_units(pipe.training_inputs(ds[i]))
            batch = collate_values(split_batch(values, 1, pipe.padded_values, ("input_latents", "prompt_embeds",
                                                                                 "prompt_embeds_mask", "edit_latents")),
                                   pipe.padded_values)
            for d in range(n_draws):
                total += flow_match_sft_loss(pipe, batch, [sample_generator(123, d, i)], {}).item()
    return total / (len(ds) * n_draws)


def test_training_lowers_the_loss(tmp_path, tiny_repo):
    """60 optimizer steps of full DiT training on two images lower the loss on fixed noise and timesteps."""
    meta = make_image_dataset(tmp_path / "data", n=2)
    before = eval_loss(load_pipe(tiny_repo), meta.parent)
    summary = run_train("--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--max_pixels", 4096,
                        "--dataset_repeat", 30, "--num_epochs", 1, "--learning_rate", 3e-3, "--model_paths",
                        model_paths_json(tiny_repo), "--output_path", tmp_path / "out", "--trainable_models", "dit",
                        "--torch_dtype", "float32", "--no_progress")
    assert summary["steps"] == 60
    pipe = load_pipe(tiny_repo)
    pipe.dit.load_state_dict(load_file(str(tmp_path / "out" / "epoch-0.safetensors")))
    after = eval_loss(pipe, meta.parent)
    print(f"fixed-noise loss before {before:.4f} after {after:.4f}")
    assert after < 0.7 * before


def test_saved_lora_loads_in_diffusers_with_the_same_image(tmp_path, tiny_repo):
    from diffusers import QwenImagePipeline as DiffusersQwen

    from difftune.core.units import run_unit

    meta = make_image_dataset(tmp_path / "data", n=2)
    run_train("--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--max_pixels", 4096,
              "--dataset_repeat", 5, "--learning_rate", 5e-3, "--model_paths", model_paths_json(tiny_repo),
              "--output_path", tmp_path / "out", "--lora_base_model", "dit", "--lora_target_modules", LORA_TARGETS,
              "--lora_rank", 4, "--lora_alpha", 8, "--torch_dtype", "float32", "--no_progress")
    lora = str(tmp_path / "out" / "epoch-0.safetensors")
    ours = load_pipe(tiny_repo)
    values = {"prompt": ["a dog"], "edit_image": None}
    run_unit(ours, ours.units[-1], values)
    ref = DiffusersQwen.from_pretrained(str(tiny_repo), dtype=torch.float32)
    ref.set_progress_bar_config(disable=True)
    kwargs = dict(prompt_embeds=values["prompt_embeds"], prompt_embeds_mask=values["prompt_embeds_mask"],
                  true_cfg_scale=1.0, height=32, width=32, num_inference_steps=3, output_type="pt")
    base = ref(**kwargs, generator=torch.Generator().manual_seed(0)).images
    ref.load_lora_weights(lora)
    theirs = ref(**kwargs, generator=torch.Generator().manual_seed(0)).images
    ours.load_lora(ours.dit, lora)
    mine = ours("a dog", cfg_scale=1.0, height=32, width=32, num_inference_steps=3, seed=0, progress=False,
                output_type="pt")
    assert (theirs - base).abs().max() > 1e-3  # the LoRA really changed the image
    assert (mine - theirs).abs().max() <= 1e-3


def test_full_dit_training_loads_into_the_diffusers_class(tmp_path, tiny_repo):
    from diffusers import QwenImageTransformer2DModel

    meta = make_image_dataset(tmp_path / "data", n=2)
    run_train("--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--max_pixels", 4096,
              "--dataset_repeat", 2, "--learning_rate", 1e-3, "--model_paths", model_paths_json(tiny_repo),
              "--output_path", tmp_path / "out", "--trainable_models", "dit", "--torch_dtype", "float32",
              "--no_progress")
    sd = load_file(str(tmp_path / "out" / "epoch-0.safetensors"))
    model = QwenImageTransformer2DModel.from_pretrained(str(tiny_repo), subfolder="transformer")
    original = {k: v.clone() for k, v in model.state_dict().items()}
    missing, unexpected = model.load_state_dict(sd, strict=True), None
    assert set(sd) == set(original)
    assert any((sd[k] - original[k]).abs().max() > 0 for k in sd)  # it trained


def test_save_steps_count_optimizer_steps(tmp_path, tiny_repo):
    meta = make_image_dataset(tmp_path / "data", n=2)
    summary = run_train("--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--max_pixels", 4096,
                        "--dataset_repeat", 4, "--gradient_accumulation_steps", 2, "--save_steps", 2,
                        "--model_paths", model_paths_json(tiny_repo), "--output_path", tmp_path / "out",
                        "--lora_base_model", "dit", "--lora_target_modules", "to_q,to_k", "--lora_rank", 2,
                        "--torch_dtype", "float32", "--no_progress")
    assert summary["steps"] == 4  # 8 micro-steps / accumulation 2
    assert sorted(Path(p).name for p in summary["saved"]) == ["step-2.safetensors", "step-4.safetensors"]
    import os

    umask = os.umask(0)
    os.umask(umask)
    for p in summary["saved"]:  # readable by others as usual (safetensors alone would make them 0600)
        assert os.stat(p).st_mode & 0o777 == 0o666 & ~umask


def test_loss_and_lr_reach_tensorboard(tmp_path, tiny_repo):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    meta = make_image_dataset(tmp_path / "data", n=2)
    run_train("--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--max_pixels", 4096,
              "--dataset_repeat", 3, "--model_paths", model_paths_json(tiny_repo), "--output_path", tmp_path / "out",
              "--lora_base_model", "dit", "--lora_target_modules", "to_q", "--lora_rank", 2, "--torch_dtype", "float32",
              "--lr_scheduler", "linear", "--lr_warmup_steps", 2, "--no_progress")
    runs = [p.parent for p in (tmp_path / "out" / "logs").rglob("events.out.tfevents*")]
    assert runs
    acc = EventAccumulator(str(runs[0]))
    acc.Reload()
    losses = [e.value for e in acc.Scalars("train/loss")]
    lrs = [e.value for e in acc.Scalars("train/lr")]
    assert len(losses) == 6 and all(v > 0 for v in losses)
    assert lrs[0] == pytest.approx(0.5e-4) and lrs[1] == pytest.approx(1e-4) and lrs[-1] < lrs[1]


def test_learning_rate_is_constant_by_default():
    from difftune.training.fit import make_lr_schedule

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=1e-4)
    sched = make_lr_schedule(opt, "constant", 0, 100)
    lrs = []
    for _ in range(10):
        lrs.append(sched.get_last_lr()[0])
        opt.step()
        sched.step()
    assert lrs == [1e-4] * 10  # no hidden lr/3 warm-up


def test_lora_checkpoint_in_reference_layout_continues(tmp_path, tiny_repo):
    """--lora_checkpoint accepts the reference's `.default` keys (no alpha: alpha = rank)."""
    meta = make_image_dataset(tmp_path / "data", n=2)
    common = ["--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--max_pixels", 4096,
              "--dataset_repeat", 2, "--model_paths", model_paths_json(tiny_repo), "--lora_base_model", "dit",
              "--lora_target_modules", "to_q,to_k", "--lora_rank", 2, "--torch_dtype", "float32", "--no_progress",
              "--lora_format", "diffusers"]  # transformer.<module> keys, alpha = rank: the reference's keys from them
    run_train(*common, "--output_path", tmp_path / "a")
    ours = load_file(str(tmp_path / "a" / "epoch-0.safetensors"))
    from safetensors.torch import save_file

    reference_layout = {k[len("transformer."):].replace(".lora_A.", ".lora_A.default.").replace(".lora_B.", ".lora_B.default."): v
                        for k, v in ours.items()}
    save_file(reference_layout, str(tmp_path / "ref.safetensors"))
    run_train(*common, "--output_path", tmp_path / "b", "--lora_checkpoint", tmp_path / "ref.safetensors",
              "--learning_rate", 0.0, "--weight_decay", 0.0)
    continued = load_file(str(tmp_path / "b" / "epoch-0.safetensors"))
    assert max((continued[k] - ours[k]).abs().max().item() for k in ours) == 0.0


BAD_CASES = {
    "missing file": (lambda d: (d / "image_1.png").unlink(), "file not found"),
    "missing column": (lambda d: (d / "metadata.csv").write_text("img,prompt\nimage_1.png,a\n"), "column"),
    "empty metadata": (lambda d: (d / "metadata.csv").write_text("image,prompt\n"), "no rows"),
    "corrupt image": (lambda d: (d / "image_1.png").write_bytes(b"\x89PNG\r\n\x1a\nbroken"), "image_1.png"),
}


@pytest.mark.parametrize("case", sorted(BAD_CASES))
def test_bad_data_is_a_one_line_error(tmp_path, tiny_repo, case, capsys):
    from difftune.cli.main import main

    meta = make_image_dataset(tmp_path / "data", n=2)
    breaker, expected = BAD_CASES[case]
    breaker(meta.parent)
    code = main(["train", "--dataset_base_path", str(meta.parent), "--dataset_metadata_path", str(meta),
                 "--model_paths", model_paths_json(tiny_repo), "--output_path", str(tmp_path / "out"),
                 "--lora_base_model", "dit", "--lora_target_modules", "to_q", "--torch_dtype", "float32",
                 "--no_progress"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and err[0].startswith("error: ") and expected in err[0], err
    assert "Traceback" not in "\n".join(err)


def test_bad_input_from_the_shell_has_no_traceback(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "difftune", "train", "--dataset_base_path", str(tmp_path),
                           "--dataset_metadata_path", str(tmp_path / "nope.csv"), "--model_paths", "[\"a\",]"],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "--model_paths" in lines[0] and "Traceback" not in proc.stderr


REFERENCE_MODELS = ("Qwen/Qwen-Image:transformer/diffusion_pytorch_model*.safetensors,"
                    "Qwen/Qwen-Image:text_encoder/model*.safetensors,"
                    "Qwen/Qwen-Image:vae/diffusion_pytorch_model.safetensors")


@pytest.mark.slow
def test_reference_commands_verbatim_with_hub_ids(tmp_path, tiny_repo, monkeypatch):
    """Seed 000's three commands exactly, with only the script path changed: hub ids resolve from a
    pre-populated DIFFTUNE_MODEL_BASE_PATH (no network), data in data/example_image_dataset."""
    from support import populate_offline_hub

    monkeypatch.chdir(tmp_path)
    populate_offline_hub(tmp_path / "models", "Qwen/Qwen-Image", tiny_repo)
    monkeypatch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "true")
    # the commands verbatim (50 repeats x 5 epochs each); one small image (32x32), as those steps are the test's time
    make_image_dataset(tmp_path / "data" / "example_image_dataset", n=1, size=(32, 32))
    lora = ["--lora_base_model", "dit", "--lora_target_modules", LORA_TARGETS, "--lora_rank", "32",
            "--use_gradient_checkpointing", "--dataset_num_workers", "8", "--find_unused_parameters", "--no_progress"]
    common = ["--learning_rate", "1e-4", "--num_epochs", "5", "--remove_prefix_in_ckpt", "pipe.dit."]
    data = ["--dataset_base_path", "data/example_image_dataset", "--dataset_metadata_path",
            "data/example_image_dataset/metadata.csv", "--max_pixels", "1048576"]
    summary = run_train(*data, "--dataset_repeat", "50", "--model_id_with_origin_paths", REFERENCE_MODELS, *common,
                        "--output_path", "./models/train/Qwen-Image_lora", *lora)
    assert summary["steps"] == 250  # 1 image x 50 repeats x 5 epochs, batch 1
    assert [Path(p).name for p in summary["saved"]] == [f"epoch-{i}.safetensors" for i in range(5)]
    assert Path("models/train/Qwen-Image_lora/training_args.json").exists()
    run_train(*data, "--dataset_repeat", "1", "--model_id_with_origin_paths", REFERENCE_MODELS.split(",", 1)[1],
              *common, "--output_path", "./models/train/Qwen-Image-LoRA-splited-cache", *lora,
              "--task", "sft:data_process")
    run_train("--dataset_base_path", "./models/train/Qwen-Image-LoRA-splited-cache", "--max_pixels", "1048576",
              "--dataset_repeat", "50", "--model_id_with_origin_paths", REFERENCE_MODELS.split(",")[0], *common,
              "--output_path", "./models/train/Qwen-Image-LoRA-splited", *lora, "--task", "sft:train")
    one = load_file("models/train/Qwen-Image_lora/epoch-4.safetensors")
    two = load_file("models/train/Qwen-Image-LoRA-splited/epoch-4.safetensors")
    assert one.keys() == two.keys()
    # Qwen-Image's default layout: diffusion_model.<module>.lora_A/B + .alpha (diffusers, ComfyUI, DiffSynth-Studio)
    assert all(k.startswith("diffusion_model.") and (".lora_" in k or k.endswith(".alpha")) for k in one)
    assert {v.dtype for v in one.values()} == {torch.float32}  # LoRA trained and saved in fp32
    # bf16 frozen weights (the reference's default dtype): equal up to bf16 rounding of the cached values
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-3


def test_edit_command_finds_the_processor_where_the_reference_does(tmp_path, tiny_repo, monkeypatch):
    """The reference's Qwen-Image-Edit LoRA command: the text encoder comes from Qwen/Qwen-Image, which has no
    processor/; the processor is the reference's default, Qwen/Qwen-Image-Edit:processor/."""
    from PIL import Image

    from support import populate_offline_hub, write_tiny_qwen_image

    monkeypatch.chdir(tmp_path)
    populate_offline_hub(tmp_path / "models", "Qwen/Qwen-Image", tiny_repo)
    populate_offline_hub(tmp_path / "models", "Qwen/Qwen-Image-Edit", write_tiny_qwen_image(tmp_path / "e", edit=True))
    assert not (tmp_path / "models" / "Qwen" / "Qwen-Image" / "processor").exists()
    monkeypatch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "true")
    data = tmp_path / "data" / "example_image_dataset"
    make_image_dataset(data, n=2, size=(32, 32))
    for i in range(2):
        Image.new("RGB", (32, 32), (40 * i, 90, 200)).save(data / f"edit_{i + 1}.png")
    (data / "metadata.csv").write_text("image,prompt,edit_image\nimage_1.png,red,edit_1.png\nimage_2.png,blue,edit_2.png\n")
    models = ("Qwen/Qwen-Image-Edit:transformer/diffusion_pytorch_model*.safetensors,"
              "Qwen/Qwen-Image:text_encoder/model*.safetensors,Qwen/Qwen-Image:vae/diffusion_pytorch_model.safetensors")
    summary = run_train("--dataset_base_path", "data/example_image_dataset", "--dataset_metadata_path",
                        "data/example_image_dataset/metadata.csv", "--data_file_keys", "image,edit_image",
                        "--extra_inputs", "edit_image", "--max_pixels", "1048576", "--model_id_with_origin_paths",
                        models, "--output_path", "./models/train/Qwen-Image-Edit_lora", "--lora_base_model", "dit",
                        "--lora_target_modules", LORA_TARGETS, "--lora_rank", "4", "--max_steps", "2",
                        "--edit_image_auto_resize", "false", "--no_progress")
    assert summary["steps"] == 2 and Path(summary["saved"][-1]).exists()
    # and --processor_path in the reference's model_id:folder form
    run_train("--dataset_base_path", "data/example_image_dataset", "--dataset_metadata_path",
              "data/example_image_dataset/metadata.csv", "--data_file_keys", "image,edit_image", "--extra_inputs",
              "edit_image", "--model_id_with_origin_paths", models, "--processor_path", "Qwen/Qwen-Image-Edit:processor/",
              "--output_path", "./out2", "--lora_base_model", "dit", "--lora_target_modules", "to_q", "--max_steps", "1",
              "--edit_image_auto_resize", "false", "--no_progress")
