"""`difftune train` on the tiny Z-Image with the current seam: a DiT LoRA one-stage and split (sft:data_process then
sft:train) giving the same weights, the Fun ControlNet trained fully from a controlnet_image column, an Omni-Base
LoRA on edit data, and the saved LoRA read by diffusers' ZImagePipeline.load_lora_weights."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from conftest import run_train
from difftune.families.z_image.components import LORA_TARGET_MODULES
from support.z_image import (CONTROLNET_REPO, OMNI_REPO, TURBO_REPO, hub_entry, load_tiny_z_image,
                                            write_control_dataset, write_edit_dataset, write_tiny_z_image_hub)
from support import write_example_dataset


@pytest.fixture(scope="module")
def hub(tmp_path_factory):
    return write_tiny_z_image_hub(tmp_path_factory.mktemp("z_image_hub"))


def flags(hub, *models, more=()):
    paths = list(models) or [hub_entry(hub, TURBO_REPO, f) for f in ("transformer", "text_encoder", "vae")]
    return ["--model_paths", json.dumps(paths), "--torch_dtype", "float32", "--learning_rate", 1e-3,
            "--dataset_repeat", 1, "--num_epochs", 1, "--seed", 5, "--no_progress", "--max_pixels", 1024,
            "--tokenizer_path", hub / TURBO_REPO / "tokenizer", *more]


LORA = ["--lora_base_model", "dit", "--lora_target_modules", LORA_TARGET_MODULES, "--lora_rank", 4]


def test_lora_one_stage_equals_split(hub, tmp_path):
    meta = write_example_dataset(tmp_path / "data", n=2, size=(32, 32))
    data = ["--dataset_base_path", tmp_path / "data", "--dataset_metadata_path", meta]
    run_train("--task", "sft", *data, "--output_path", tmp_path / "one", *flags(hub, more=LORA))
    run_train("--task", "sft:data_process", *data, "--output_path", tmp_path / "cache", *flags(hub, more=LORA))
    run_train("--task", "sft:train", "--dataset_base_path", tmp_path / "cache", "--output_path", tmp_path / "two",
              *flags(hub, more=LORA))
    one, two = (load_file(str(tmp_path / d / "epoch-0.safetensors")) for d in ("one", "two"))
    assert one.keys() == two.keys()
    # the reference's targets in every block: 4 attention projections and the SwiGLU's 3 (refiners included)
    blocks = 3 + 2 + 2
    # the default layout: diffusion_model.<module>.lora_A / lora_B and its .alpha
    assert len([k for k in one if ".lora_" in k]) == 2 * 7 * blocks and all(k.startswith("diffusion_model.") for k in one)
    assert any(k.endswith("feed_forward.w2.lora_B.weight") for k in one)
    diff = max((one[k] - two[k]).abs().max().item() for k in one)
    print(f"z-image LoRA one-stage vs split: max difference {diff:.2e}")
    assert diff <= 1e-5 and max(v.abs().max().item() for k, v in one.items() if "lora_B" in k) > 0


def test_lora_loads_in_diffusers_at_the_trained_strength(hub, tmp_path):
    from diffusers import ZImagePipeline as Theirs

    meta = write_example_dataset(tmp_path / "data", n=1, size=(32, 32))
    run_train("--task", "sft", "--dataset_base_path", tmp_path / "data", "--dataset_metadata_path", meta,
              "--output_path", tmp_path / "out", *flags(hub, more=LORA))
    path = tmp_path / "out" / "epoch-0.safetensors"
    ours = load_tiny_z_image(hub)
    ours.load_lora(ours.dit, str(path))
    theirs = Theirs.from_pretrained(str(hub / TURBO_REPO), torch_dtype=torch.float32)
    theirs.load_lora_weights(str(path))
    theirs.fuse_lora()
    a, b = ours.dit.state_dict(), {k.replace(".base_layer", ""): v for k, v in theirs.transformer.state_dict().items()
                                   if "lora_" not in k}
    before = load_tiny_z_image(hub).dit.state_dict()
    changed = [k for k in a if not torch.equal(a[k], before[k])]
    diff = max((a[k] - b[k]).abs().max().item() for k in a)
    print(f"z-image LoRA fused by difftune vs diffusers: {len(changed)} weights changed, max difference {diff:.2e}")
    assert len(changed) == 7 * 7 and diff <= 1e-6


def test_fun_controlnet_full_training_from_a_control_column(hub, tmp_path):
    meta = write_control_dataset(tmp_path / "data", n=2, size=(32, 32))
    models = [hub_entry(hub, TURBO_REPO, f) for f in ("transformer", "text_encoder", "vae")] + \
        [str(hub / CONTROLNET_REPO / "Z-Image-Turbo-Fun-Controlnet-Tile-2.1-8steps.safetensors")]
    run_train("--task", "sft", "--dataset_base_path", tmp_path / "data", "--dataset_metadata_path", meta,
              "--data_file_keys", "image,controlnet_image", "--extra_inputs", "controlnet_image",
              "--trainable_models", "controlnet", "--remove_prefix_in_ckpt", "pipe.controlnet.",
              "--output_path", tmp_path / "out", *flags(hub, *models))
    saved = load_file(str(tmp_path / "out" / "epoch-0.safetensors"))
    base = load_file(models[-1])
    assert saved.keys() == base.keys()  # the file's own key names: it loads where the released file does
    moved = [k for k in saved if not torch.equal(saved[k].float(), base[k].float())]
    assert len(moved) > len(saved) // 2


def test_omni_base_lora_on_edit_images(hub, tmp_path):
    meta = write_edit_dataset(tmp_path / "data", n=2, size=(32, 32), edit_size=(48, 32))
    models = [hub_entry(hub, OMNI_REPO, "transformer"), hub_entry(hub, OMNI_REPO, "siglip"), hub_entry(hub, TURBO_REPO, "text_encoder"),
              hub_entry(hub, TURBO_REPO, "vae")]
    run_train("--task", "sft", "--dataset_base_path", tmp_path / "data", "--dataset_metadata_path", meta,
              "--data_file_keys", "image,edit_image", "--extra_inputs", "edit_image", "--output_path",
              tmp_path / "out", *flags(hub, *models, more=LORA))
    saved = load_file(str(tmp_path / "out" / "epoch-0.safetensors"))
    assert any(k.startswith("diffusion_model.siglip_refiner.") for k in saved)  # the SigLIP refiner is trained too
    assert max(v.abs().max().item() for k, v in saved.items() if "siglip_refiner" in k and "lora_B" in k) > 0


@pytest.mark.parametrize("case,models,data,message", [
    ("edit images on Turbo's DiT", "turbo", "edit", "edit images need Z-Image-Omni-Base's DiT"),
    ("edit images without SigLIP2", "omni_no_siglip", "edit", "need its SigLIP2 image encoder"),
    ("a ControlNet without control images", "controlnet", "plain", "the data has no control image"),
    ("control images without a ControlNet", "turbo", "control", "no Fun ControlNet loaded"),
    ("a ControlNet on Omni-Base", "omni_controlnet", "control", "not Omni-Base's"),
])
def test_models_and_data_that_do_not_go_together_are_refused_before_loading(hub, tmp_path, case, models, data,
                                                                            message):
    from conftest import setup_run
    from difftune.errors import UserError
    from support.z_image import CONTROLNET_FILES, omni_model_paths, turbo_model_paths

    controlnet = str(hub / CONTROLNET_REPO / CONTROLNET_FILES[0])
    paths = {"turbo": turbo_model_paths(hub), "omni_no_siglip": omni_model_paths(hub, siglip=False),
             "controlnet": [*turbo_model_paths(hub), controlnet],
             "omni_controlnet": [*omni_model_paths(hub), controlnet]}[models]
    writers = {"edit": (write_edit_dataset, "edit_image"), "control": (write_control_dataset, "controlnet_image"),
               "plain": (write_example_dataset, None)}
    write, column = writers[data]
    meta = write(tmp_path / "data", n=1)
    columns = ["--data_file_keys", f"image,{column}", "--extra_inputs", column] if column else []
    with pytest.raises(UserError, match=message) as err:
        setup_run("--dataset_base_path", tmp_path / "data", "--dataset_metadata_path", meta, *columns,
                  *flags(hub, *paths, more=LORA))
    assert "\n" not in str(err.value), case


def test_npu_patch_is_accepted_with_a_note(hub, tmp_path, capsys):
    meta = write_example_dataset(tmp_path / "data", n=1, size=(32, 32))
    run_train("--task", "sft", "--dataset_base_path", tmp_path / "data", "--dataset_metadata_path", meta,
              "--output_path", tmp_path / "out", "--enable_npu_patch", "--max_steps", 1, *flags(hub, more=LORA))
    out = capsys.readouterr().out
    assert "note: --enable_npu_patch:" in out and "difftune has no fused NPU kernels" in out
    assert list((tmp_path / "out").glob("*.safetensors"))


@pytest.mark.parametrize("case", ["edit_lora", "controlnet_lora", "controlnet_full", "trajectory_imitation"])
def test_variants_one_stage_equal_split(hub, tmp_path, case):
    """Each variant's training, one stage and split (stage 1 caches the edit images' latents, SigLIP features and
    text pieces, the control context, the negative prompt), gives the same weights. Stage 1 encodes one sample at
    a time here, as one-stage training does: encoding two in a batch changes the encodings by float round-off,
    which Adam magnifies on a fully trained model's near-zero gradients (to 1.6e-4 after two steps at lr 1e-3
    for the ControlNet)."""
    from support.z_image import CONTROLNET_FILES, omni_model_paths, turbo_model_paths

    controlnet = str(hub / CONTROLNET_REPO / CONTROLNET_FILES[2])
    if case == "edit_lora":
        meta = write_edit_dataset(tmp_path / "data", n=2, size=(32, 32), edit_size=(48, 32))
        models, more = omni_model_paths(hub), ["--data_file_keys", "image,edit_image", "--extra_inputs",
                                               "edit_image", *LORA]
    elif case.startswith("controlnet"):
        meta = write_control_dataset(tmp_path / "data", n=2, size=(32, 32))
        models = [*turbo_model_paths(hub), controlnet]
        more = ["--data_file_keys", "image,controlnet_image", "--extra_inputs", "controlnet_image"]
        more += LORA if case == "controlnet_lora" else ["--trainable_models", "controlnet",
                                                       "--remove_prefix_in_ckpt", "pipe.controlnet."]
    else:
        meta = write_example_dataset(tmp_path / "data", n=2, size=(32, 32))
        models, more = turbo_model_paths(hub), LORA
    task = "trajectory_imitation" if case == "trajectory_imitation" else "sft"
    common = [*flags(hub, *models, more=more), "--max_steps", 2, "--data_process_batch_size", 1]
    data = ["--dataset_base_path", tmp_path / "data", "--dataset_metadata_path", meta]
    run_train("--task", task, *data, "--output_path", tmp_path / "one", *common)
    run_train("--task", f"{task}:data_process", *data, "--output_path", tmp_path / "cache", *common)
    run_train("--task", f"{task}:train", "--dataset_base_path", tmp_path / "cache", "--output_path", tmp_path / "two",
              *common)
    (one,), (two,) = (list((tmp_path / d).glob("*.safetensors")) for d in ("one", "two"))
    one, two = load_file(str(one)), load_file(str(two))
    assert one.keys() == two.keys() and one
    diff = max((one[k].float() - two[k].float()).abs().max().item() for k in one)
    print(f"z-image {case}: one stage vs split, max weight difference {diff:.2e}")
    assert diff <= 1e-5
    if case != "controlnet_full":  # it trained: the LoRA left its zero start
        assert max(v.abs().max().item() for k, v in one.items() if ".lora_B." in k) > 0
