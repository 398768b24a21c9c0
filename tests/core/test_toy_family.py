"""A family that is not Qwen-Image (tests/support/toys/toy_family.py, written from docs/adding_a_family.md) trains
through the `train` command one-stage and split with equal weights, and the split follows its declarations."""

import json
import sys
import textwrap

import pytest
import torch
from safetensors.torch import load_file

import difftune.models as models_pkg
from conftest import make_image_dataset, run_train, setup_run, train_args
from difftune import gradient_checkpoint_forward, load_component
from difftune.core.family import families
from difftune.errors import UserError
from difftune.training.config import TaskSpec
from support.toys import toy_family


@pytest.fixture(scope="module")
def toy_models(tmp_path_factory):
    return toy_family.write_toy_models(tmp_path_factory.mktemp("toy_models"))


@pytest.fixture(scope="module")
def toy_data(tmp_path_factory):
    return make_image_dataset(tmp_path_factory.mktemp("toy_data"), n=2, size=(32, 24))


def common(models, flags):
    return ["--family", "toy", "--model_paths", json.dumps(list(models.values())), "--torch_dtype", "float32",
            *flags, "--learning_rate", 1e-2, "--num_epochs", 2, "--seed", 3, "--remove_prefix_in_ckpt",
            "pipe.denoiser.", "--use_gradient_checkpointing", "--no_progress", "--enable_tensorboard_log", "false"]


# what is trained -> (flags, stage-2 units, cached names, stage-1 models, stage-2 models, {saved file: model})
CASES = {
    "denoiser": (["--trainable_models", "denoiser"], (), ("input_latents", "prompt_emb"),
                 ("image_encoder", "prompt_encoder"), ("denoiser",), {"epoch-1.safetensors": "denoiser"}),
    "prompt_encoder,denoiser": (
        ["--trainable_models", "prompt_encoder,denoiser"], ("ToyPromptEncoderUnit",), ("input_latents", "prompt"),
        ("image_encoder",), ("denoiser", "prompt_encoder"),
        {"epoch-1-denoiser.safetensors": "denoiser", "epoch-1-prompt_encoder.safetensors": "prompt_encoder"}),
    "image_encoder,denoiser": (
        ["--trainable_models", "image_encoder,denoiser"], ("ToyImageEncoderUnit",),
        ("height", "input_image", "noise", "prompt_emb", "width"), ("prompt_encoder",), ("denoiser", "image_encoder"),
        {"epoch-1-denoiser.safetensors": "denoiser", "epoch-1-image_encoder.safetensors": "image_encoder"}),
    "lora:prompt_encoder": (
        ["--lora_base_model", "prompt_encoder", "--lora_target_modules", "proj", "--lora_rank", 2],
        ("ToyPromptEncoderUnit",), ("input_latents", "prompt"), ("image_encoder",), ("denoiser", "prompt_encoder"),
        {"epoch-1.safetensors": None}),
}


@pytest.mark.parametrize("case", list(CASES))
def test_split_follows_the_declarations(case):
    flags, stage2, frontier, stage1_models, stage2_models, _ = CASES[case]
    split = setup_run("--dataset_base_path", ".", "--family", "toy", *flags).split
    assert tuple(u.name for u in split.stage2) == stage2
    assert split.frontier == frontier
    assert split.stage1_models == stage1_models
    assert split.stage2_models == stage2_models


@pytest.mark.parametrize("case", list(CASES))
def test_one_stage_equals_two_stage(tmp_path, toy_models, toy_data, case, monkeypatch):
    flags, _, frontier, stage1_models, _, saved = CASES[case]
    data = toy_data.parent
    run_train("--task", "sft", "--dataset_base_path", data, "--dataset_metadata_path", toy_data,
              "--output_path", tmp_path / "one", *common(toy_models, flags))
    built = []
    real = models_pkg.load_component
    monkeypatch.setattr(models_pkg, "load_component",
                        lambda config, *a, **k: built.append(real(config, *a, **k)) or built[-1])
    run_train("--task", "sft:data_process", "--dataset_base_path", data, "--dataset_metadata_path", toy_data,
              "--output_path", tmp_path / "cache", *common(toy_models, flags))
    stage1_loaded = sorted(c.name for c in built)
    run_train("--task", "sft:train", "--dataset_base_path", tmp_path / "cache", "--output_path", tmp_path / "two",
              *common(toy_models, flags))

    assert stage1_loaded == list(stage1_models)  # stage 1 never builds a trainable model
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    assert sorted(k for k in manifest["frontier"] if not k.endswith("__difftune_images__")) == list(frontier)

    for name, model in saved.items():
        one, two = load_file(str(tmp_path / "one" / name)), load_file(str(tmp_path / "two" / name))
        assert one.keys() == two.keys() and len(one) > 0
        assert max((one[k] - two[k]).abs().max().item() for k in one) <= 1e-5
        if model is None:  # a LoRA: B starts at zero, so training made it non-zero
            assert sorted(one) == ["prompt_encoder.proj.lora_A.weight", "prompt_encoder.proj.lora_B.weight"]
            assert one["prompt_encoder.proj.lora_B.weight"].abs().max() > 0
            continue
        start = load_component(toy_models[model], torch_dtype=torch.float32).module.state_dict()
        trained = {k.removeprefix(f"pipe.{model}."): v for k, v in one.items()}
        assert trained.keys() == start.keys()
        assert any(not torch.equal(start[k], v) for k, v in trained.items())  # it did train


def test_image_encoder_is_clean_in_training_and_noised_in_inference(toy_models, toy_data):
    from PIL import Image

    pipe = toy_family.ToyPipeline()
    pipe.image_encoder = load_component(toy_models["image_encoder"], torch_dtype=torch.float32).module
    unit = toy_family.ToyImageEncoderUnit()
    image = Image.open(toy_data.parent / "image_1.png")
    noise = torch.randn(1, 4, 6, 8)
    values = {"input_image": image, "noise": noise, "height": 24, "width": 32}

    pipe.scheduler.set_timesteps(4, image_seq_len=48, denoising_strength=0.5)
    inference = pipe.run_units(dict(values), [unit])
    pipe.scheduler.set_training()
    training = pipe.run_units(dict(values), [unit])

    assert torch.equal(training["latents"], noise)  # the loss noises the clean latents itself
    assert torch.equal(training["input_latents"], inference["input_latents"])
    sigma = pipe.scheduler.sigmas[0]
    assert 0 < sigma < 1
    assert torch.allclose(inference["latents"], (1 - sigma) * inference["input_latents"] + sigma * noise, atol=1e-6)


def test_model_fn_checkpoints_each_block_without_changing_gradients(toy_models):
    pipe = toy_family.ToyPipeline()
    pipe.denoiser = load_component(toy_models["denoiser"], torch_dtype=torch.float32).module
    pipe.denoiser.requires_grad_(True)
    calls = []
    for block in pipe.denoiser.blocks:  # counted in forward itself: torch runs no hooks when it recomputes
        block.forward = lambda *a, _forward=block.forward, **k: calls.append(1) or _forward(*a, **k)
    latents, emb = torch.randn(2, 4, 6, 8), torch.randn(2, 16, 16)
    grads = []
    for checkpointing, offload in ((False, False), (True, False), (True, True)):
        calls.clear()
        pipe.denoiser.zero_grad()
        out = pipe.model_fn(latents, torch.tensor([100.0, 700.0]), emb, use_gradient_checkpointing=checkpointing,
                            use_gradient_checkpointing_offload=offload)
        out.square().mean().backward()
        grads.append([p.grad.clone() for p in pipe.denoiser.parameters()])
        # with checkpointing each block runs again in backward instead of keeping its activations
        assert len(calls) == (2 if checkpointing else 1) * len(pipe.denoiser.blocks)
    for other in grads[1:]:
        assert all(torch.allclose(a, b, atol=1e-6) for a, b in zip(grads[0], other))
    block = pipe.denoiser.blocks[0]
    with torch.no_grad():  # nothing to recompute without gradients: a plain call
        calls.clear()
        gradient_checkpoint_forward(block, True, True, latents, cond=torch.randn(2, 16))
        assert len(calls) == 1


def test_inference_runs_the_same_units(toy_models):
    pipe = toy_family.ToyPipeline()
    for name, path in toy_models.items():
        setattr(pipe, name, load_component(path, torch_dtype=torch.float32).module)
    a = pipe("a red circle", height=24, width=32, num_inference_steps=3, seed=7, cfg_scale=2.0)
    b = pipe("a red circle", height=24, width=32, num_inference_steps=3, seed=7, cfg_scale=2.0)
    assert a.shape == (1, 4, 6, 8) and torch.isfinite(a).all() and torch.equal(a, b)


def test_family_from_an_entry_point(tmp_path, monkeypatch):
    def install(folder, entry_points):
        dist = folder / "toyplugin-0.1.dist-info"
        dist.mkdir(parents=True)
        (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: toyplugin\nVersion: 0.1\n")
        (dist / "entry_points.txt").write_text(textwrap.dedent(entry_points))
        monkeypatch.syspath_prepend(str(folder))

    install(tmp_path / "broken", """
        [difftune.families]
        toy_plugin = support.toys.toy_family:FAMILY
        broken_plugin = no_such_module_here:Pipeline
    """)
    with pytest.raises(UserError, match=r"family 'broken_plugin' \(entry point no_such_module_here:Pipeline\)"):
        families()
    sys.path.remove(str(tmp_path / "broken"))  # uninstalled (monkeypatch restores sys.path afterwards)
    install(tmp_path / "fixed", "[difftune.families]\ntoy_plugin = support.toys.toy_family:FAMILY\n")
    assert families()["toy_plugin"] is toy_family.FAMILY


def test_unknown_family_is_a_one_line_error(tmp_path, toy_data):
    with pytest.raises(UserError, match=r"--family toyy: unknown family \(known: .*qwen_image.*toy"):
        run_train("--family", "toyy", "--dataset_base_path", toy_data.parent, "--dataset_metadata_path", toy_data,
                  "--output_path", tmp_path / "out")


# -- features ---------------------------------------------------------------------------------------------------

def _reference_data(folder):
    """The toy data set with a reference image column."""
    from PIL import Image

    meta = make_image_dataset(folder, n=2, size=(32, 24))
    Image.new("RGB", (32, 24), (10, 200, 90)).save(folder / "reference.png")
    rows = [line.split(",", 1) for line in meta.read_text().splitlines()[1:]]
    path = folder / "with_reference.csv"
    path.write_text("image,reference_image,prompt\n" + "".join(f"{i},reference.png,{p}\n" for i, p in rows))
    return path


def test_a_feature_runs_and_is_cached_only_when_the_data_uses_it(tmp_path, toy_models):
    meta = _reference_data(tmp_path / "data")
    flags = ["--trainable_models", "denoiser"]
    plain = setup_run("--dataset_base_path", meta.parent, "--dataset_metadata_path", meta.parent / "metadata.csv",
                      *common(toy_models, flags))
    assert plain.features == {"base"} and "ToyReferenceUnit" not in [u.name for u in plain.split.stage1]
    assert plain.split.frontier == ("input_latents", "prompt_emb")
    with_ref = setup_run("--dataset_base_path", meta.parent, "--dataset_metadata_path", meta, "--data_file_keys",
                         "image,reference_image", "--extra_inputs", "reference_image", *common(toy_models, flags))
    assert with_ref.features == {"base", "reference"}
    assert "ToyReferenceUnit" in [u.name for u in with_ref.split.stage1]
    assert with_ref.split.frontier == ("input_latents", "prompt_emb", "reference_latents")
    # the reference image changes what is trained: the feature's values reach model_fn
    out = {}
    for name, extra in (("plain", ["--dataset_metadata_path", meta.parent / "metadata.csv"]),
                        ("reference", ["--dataset_metadata_path", meta, "--data_file_keys", "image,reference_image",
                                       "--extra_inputs", "reference_image"])):
        run_train("--task", "sft", "--dataset_base_path", meta.parent, *extra, "--output_path", tmp_path / name,
                  *common(toy_models, flags), "--num_epochs", 1)
        out[name] = load_file(str(tmp_path / name / "epoch-0.safetensors"))
    assert max((out["plain"][k] - out["reference"][k]).abs().max().item() for k in out["plain"]) > 1e-4


def test_adding_a_feature_to_a_family_leaves_its_existing_caches_valid(tmp_path, toy_models, toy_data, monkeypatch,
                                                                      capsys):
    """A cache made before the family gained a feature (a unit and a model_fn input of its own) is still the cache
    of runs that do not use it: stage 1 finds it complete, stage 2 trains from it."""
    import dataclasses

    import difftune.core.family as family_mod
    from difftune.core.features import Feature

    flags = ["--trainable_models", "denoiser"]
    data = ["--dataset_base_path", toy_data.parent, "--dataset_metadata_path", toy_data]
    run_train("--task", "sft:data_process", *data, "--output_path", tmp_path / "cache", *common(toy_models, flags))
    before = json.loads((tmp_path / "cache" / "manifest.json").read_text())["fingerprint_hash"]

    class Mask(toy_family.ToyReferenceUnit):  # a new feature: its own column, unit and model_fn input
        inputs = ("mask_image", "height", "width")
        outputs = ("mask_latents",)
        feature = "mask"

        def process(self, pipe, mask_image, height, width):
            return {} if mask_image is None else super().process(pipe, mask_image, height, width)

    grown = type("ToyPipeline", (toy_family.ToyPipeline,), {
        "features": (*toy_family.ToyPipeline.features, Feature("mask", columns=("mask_image",),
                                                               model_fn_inputs=("mask_latents",))),
        "__init__": lambda self, *a, **k: (toy_family.ToyPipeline.__init__(self, *a, **k),
                                           setattr(self, "units", [*self.all_units, Mask()]))[0]})
    monkeypatch.setattr(family_mod, "_REGISTERED", dict(family_mod._REGISTERED))
    family_mod.register_family(dataclasses.replace(toy_family.FAMILY, pipeline=grown))
    try:
        assert "mask" in setup_run(*data, "--family", "toy").pipeline.feature_names()
        capsys.readouterr()
        run_train("--task", "sft:data_process", *data, "--output_path", tmp_path / "cache", *common(toy_models, flags))
        assert "resuming stage 1: 2 sample(s) already cached" in capsys.readouterr().out  # nothing re-encoded
        assert json.loads((tmp_path / "cache" / "manifest.json").read_text())["fingerprint_hash"] == before
        run_train("--task", "sft:train", "--dataset_base_path", tmp_path / "cache", "--output_path", tmp_path / "two",
                  *common(toy_models, flags))
        assert (tmp_path / "two" / "epoch-1.safetensors").is_file()
    finally:
        family_mod.register_family(toy_family.FAMILY)  # the class attribute `spec` points back at the toy again
