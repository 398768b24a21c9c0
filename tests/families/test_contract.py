"""The family contract: every registered family (Qwen-Image, the toy family of docs/adding_a_family.md, and any
that registers later) passes the same checks, from its tiny models (`support.register_tiny`):

- it is recognised from its weights alone, and no other family claims them;
- its units keep to their declarations under the enforcing runner, in training and inference;
- split training equals one-stage training (<= 1e-5, fp32; a family may state a measured bound, `TinyFamily.split_tolerance`) for a LoRA on the denoiser and each other
  trainable set the family names;
- stage 2 builds only the models the split says it uses (no stage-1-only model), from a plain run's cache that holds no
  feature's values;
- `--batch_size 2` trains what `--batch_size 1 --gradient_accumulation_steps 2` trains, and that LoRA loads back
  exactly (as an adapter and fused).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

import difftune.models as models_pkg
import support.toys  # noqa: F401  (registers the toy families: image, audio, a clip with sound, ε, v)
from conftest import run_train
from difftune.core.family import families, get_family, recognise
from difftune.errors import UserError
from difftune.models import ModelConfig
from support import tiny_family
from difftune.training.config import TaskSpec

FAMILIES = sorted(families())


@pytest.fixture(scope="module", params=FAMILIES)
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(f"tiny_{request.param}")
    t = tiny_family(request.param, folder)
    t.metadata = t.write_dataset(folder / "data")
    t.name = request.param
    return t


def flags(t, *more):
    return ["--family", t.name, "--model_paths", json.dumps(t.model_paths), "--torch_dtype", "float32",
            "--learning_rate", 1e-3, "--dataset_repeat", 2, "--num_epochs", 1, "--seed", 5, "--no_progress",
            "--enable_tensorboard_log", "false", *t.flags, *more]


def lora_flags(t):
    return ["--lora_base_model", t.lora_base_model, "--lora_target_modules", t.lora_target_modules, "--lora_rank", 4]


def cases(t):
    return {"denoiser_lora": lora_flags(t), **{k: list(v) for k, v in t.trainable_cases.items()}}


def one_stage_and_split(t, root, case_flags):
    data = t.metadata.parent
    run_train("--task", "sft", "--dataset_base_path", data, "--dataset_metadata_path", t.metadata,
              "--output_path", root / "one", *flags(t, *case_flags))
    run_train("--task", "sft:data_process", "--dataset_base_path", data, "--dataset_metadata_path", t.metadata,
              "--output_path", root / "cache", *flags(t, *case_flags))
    run_train("--task", "sft:train", "--dataset_base_path", root / "cache", "--output_path", root / "two",
              *flags(t, *case_flags))
    return root / "one", root / "two"


def test_recognised_from_its_weights_alone(tiny):
    configs = [ModelConfig(p) for p in tiny.model_paths]
    spec, found = recognise(configs, None, log=lambda *a: None)
    assert spec.name == tiny.name
    assert sorted(slot for slot, _, _ in found) == sorted(set(spec.slots) - set(tiny.optional_slots))
    for other in FAMILIES:
        if other != tiny.name:  # another family's components never claim these weights
            with pytest.raises(UserError):
                recognise([ModelConfig(tiny.model_paths[0])], other)


def test_units_keep_to_their_declarations(tiny):
    """Every unit reaches only its declared models and writes only declared names (the runner raises
    otherwise), in training and inference; declarations name real slots and never write settings."""
    from difftune.core.build import build_pipeline
    from difftune.data import UnifiedDataset

    spec = get_family(tiny.name)
    for cls in spec.pipelines:  # the family's pipeline and its variants' classes
        instance = cls()
        for unit in instance.all_units:
            assert set(unit.models) <= set(cls.model_names), unit
            assert not set(unit.writes()) & set(cls.settings), unit
            assert unit.feature in cls.feature_names(), (cls.__name__, unit, unit.feature)
        written = {n for u in instance.all_units for n in u.writes()}
        for name in instance.model_fn_inputs_for(cls.feature_names()):
            assert name in written, f"{cls.__name__}'s model_fn reads {name}, which no unit declares"
    pipe = build_pipeline(spec, [ModelConfig(p) for p in tiny.model_paths], device="cpu", torch_dtype=torch.float32)
    factor = pipe.stream.division
    size = dict(base_path=tiny.metadata.parent, height=None, width=None, max_pixels=4096,
                height_division_factor=factor, width_division_factor=factor)
    streams = pipe.target.streams
    dataset = UnifiedDataset(base_path=tiny.metadata.parent, metadata_path=tiny.metadata,
                             data_file_keys=tuple(dict.fromkeys(["image", "video", *(s.column for s in streams)])),
                             present_keys_only=True,
                             main_data_operator=streams[0].operator(size),
                             special_operator_map={s.column: s.operator(size) for s in streams[1:]})
    pipe.scheduler.set_training()
    values = pipe.training_inputs(dataset[0])
    pipe.run_units(values)  # training
    assert all(values.get(s.input_latents) is not None for s in streams)
    pipe.scheduler.training = False
    out = pipe("a prompt", **tiny.call_args, num_inference_steps=2, seed=0, cfg_scale=2.0)  # inference, with cfg
    assert out is not None


def _args(t, *more):
    from conftest import train_args

    return train_args("--dataset_base_path", t.metadata.parent, *flags(t, *more))


VALIDATION = ("--validation_prompts", "a red circle|a blue square", "--validation_inference_steps", 2,
              "--validation_size", 32)


def assert_rendered(out, label):
    """The run rendered its last validation grid: a picture, not a blank."""
    from PIL import Image

    grids = sorted((out / "validation").glob("step-*.png"))
    assert grids, label
    with Image.open(grids[-1]) as grid:
        pixels = grid.convert("L").getextrema()
    assert grid.size[0] >= 32 and pixels[0] < pixels[1], label


def test_split_equals_one_stage(tiny, tmp_path):
    for name, case_flags in cases(tiny).items():
        # the denoiser LoRA on the base data is also the "base" variant of test_every_variant_trains_and_renders_
        # validation: it renders its validation grids here (at the end, after the compared checkpoints are written)
        base = name == "denoiser_lora"
        one, two = one_stage_and_split(tiny, tmp_path / name, [*case_flags, *(VALIDATION if base else ())])
        if base:
            for out in (one, two):
                assert_rendered(out, ("base", out.name))
        files = sorted(p.name for p in one.glob("*.safetensors"))
        assert files and files == sorted(p.name for p in two.glob("*.safetensors")), name
        for f in files:
            a, b = _effective(load_file(str(one / f))), _effective(load_file(str(two / f)))
            assert a.keys() == b.keys() and a, (name, f)
            diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
            assert diff <= tiny.split_tolerance, (name, f, diff)


def _effective(state: dict) -> dict:
    """A LoRA file's tensors with alpha / rank applied to lora_B where the layout keeps alpha apart (comfyui), as
    diffusers' layout stores them: the weights' update, not its scale, is what one stage and split must agree on."""
    out = dict(state)
    for key, alpha in state.items():
        if key.endswith(".alpha"):
            module = key[: -len(".alpha")]
            if f"{module}.lora_B.weight" in state:
                rank = state[f"{module}.lora_A.weight"].shape[0]
                out[f"{module}.lora_B.weight"] = state[f"{module}.lora_B.weight"].float() * (alpha.float() / rank)
    return out


def test_batch_2_equals_batch_1_with_accumulation_2_and_the_lora_loads_back_exactly(tiny, tmp_path):
    from difftune.lora import fuse_lora, load_lora_file, load_lora_into, lora_state_dict

    data = tiny.metadata.parent
    # diffusers' layout (the family's default may rename modules: tests/lora/test_lora_readers.py reads that one back)
    common = ["--task", "sft", "--dataset_base_path", data, "--dataset_metadata_path", tiny.metadata,
              "--lora_format", "diffusers"]
    run_train(*common, "--output_path", tmp_path / "b2", *flags(tiny, *lora_flags(tiny), "--batch_size", 2))
    run_train(*common, "--output_path", tmp_path / "a2",
              *flags(tiny, *lora_flags(tiny), "--gradient_accumulation_steps", 2))
    path = tmp_path / "a2" / "epoch-0.safetensors"
    batched, saved = load_file(str(tmp_path / "b2" / "epoch-0.safetensors")), load_file(str(path))
    assert batched.keys() == saved.keys() and saved
    # the same sums in another order: within the family's float tolerance (1e-5 unless its tiny models declare
    # more; Z-Image's differs by 1.8e-5 on some CPUs' kernels)
    assert max((batched[k] - saved[k]).abs().max().item() for k in saved) <= tiny.split_tolerance

    # the saved LoRA loads back exactly, as an adapter and fused
    spec = get_family(tiny.name)
    prefix = spec.lora_prefix(tiny.lora_base_model)
    assert all(k.startswith(prefix + ".") for k in saved)
    assert any(v.abs().max() > 0 for k, v in saved.items() if ".lora_B." in k)  # it trained

    slot_config = next(ModelConfig(p) for p in tiny.model_paths
                       if recognise([ModelConfig(p)], tiny.name)[1][0][0] == tiny.lora_base_model)

    def fresh():
        return models_pkg.load_component(slot_config, spec.components, torch_dtype=torch.float32).module

    imported = load_lora_file(path)
    # as an adapter (continuing training): the same weights
    model = fresh()
    load_lora_into(model, imported, component=prefix)
    back = lora_state_dict(model)
    canonical = {k[len(prefix) + 1:]: v for k, v in saved.items()}
    assert back.keys() == canonical.keys()
    assert all(torch.equal(back[k], canonical[k].float()) for k in back)
    # fused: W + (alpha / r) B A for every module
    base, fused = fresh(), fresh()
    fuse_lora(fused, imported, component=prefix)
    base_sd, fused_sd = base.state_dict(), fused.state_dict()
    alphas = imported.alphas[imported.select(prefix)]
    for k in [k for k in canonical if k.endswith(".lora_A.weight")]:
        module = k[: -len(".lora_A.weight")]
        a, b = canonical[k].float(), canonical[f"{module}.lora_B.weight"].float()
        want = base_sd[f"{module}.weight"] + (alphas[module] / a.shape[0]) * (b @ a)
        assert torch.allclose(fused_sd[f"{module}.weight"], want, atol=1e-6), module


def test_every_variant_trains_and_renders_validation(tiny, tmp_path):
    """Each variant (its features, or its own pipeline class) trains one-stage and split, and renders its validation
    images in both: from the data set, and from the stage-1 cache (its prompts and conditioning cached). The base
    variant (the denoiser LoRA on the family's base data) is trained and rendered in test_split_equals_one_stage."""
    if not tiny.variants:
        pytest.skip(f"{tiny.name} has no variant beyond its base (trained and rendered in test_split_equals_one_stage)")
    for name, variant in tiny.variants.items():
        root = tmp_path / name
        paths = variant.model_paths() if callable(variant.model_paths) else variant.model_paths or tiny.model_paths
        meta = (variant.write_dataset or tiny.write_dataset)(root / "data")
        common = ["--family", tiny.name, "--model_paths", json.dumps(paths), "--torch_dtype", "float32",
                  "--learning_rate", 1e-3, "--seed", 5, "--no_progress", "--enable_tensorboard_log", "false",
                  *tiny.flags, *variant.flags, *lora_flags(tiny), "--max_steps", 1, "--validation_prompts",
                  "a red circle|a blue square", "--validation_inference_steps", 2, "--validation_size", 32]
        data = ["--dataset_base_path", meta.parent, "--dataset_metadata_path", meta]
        run_train("--task", "sft", *data, "--output_path", root / "one", *common)
        run_train("--task", "sft:data_process", *data, "--output_path", root / "cache", *common)
        run_train("--task", "sft:train", "--dataset_base_path", root / "cache", "--output_path", root / "two", *common)
        for out in ("one", "two"):
            assert_rendered(root / out, (name, out))
        fingerprint = json.loads((root / "cache" / "manifest.json").read_text())["fingerprint"]
        features, pipeline = fingerprint["features"], fingerprint.get("pipeline")
        # a variant is a feature the run switched on, or a variant pipeline class (Qwen-Image-Layered, Step1X-Edit)
        own_class = pipeline is not None and pipeline != get_family(tiny.name).pipeline.__name__
        assert (name in features) or own_class, (name, features, pipeline)


def test_a_plain_run_caches_no_feature_and_stage2_builds_only_what_it_uses(tiny, tmp_path, capsys, monkeypatch):
    """A run of the family's base data (text-to-image / text-to-video) runs, logs and caches its base units only: no
    unit of a feature, and none of a feature's values in the cache index. Its stage 2, from that cache, builds only
    the models the split says it uses (no stage-1-only model)."""
    case_flags = lora_flags(tiny)
    data = tiny.metadata.parent
    run_train("--task", "sft:data_process", "--dataset_base_path", data, "--dataset_metadata_path", tiny.metadata,
              "--output_path", tmp_path / "cache", *flags(tiny, *case_flags))
    log = capsys.readouterr().out
    spec = get_family(tiny.name)
    pipe = spec.pipeline()
    feature_units = [u.name for u in pipe.all_units if u.feature != "base"]
    base_values = {n for u in pipe.all_units if u.feature == "base" for n in u.writes(cfg=True)}
    feature_values = ({n for f in pipe.features for n in f.model_fn_inputs} | {
        n for u in pipe.all_units if u.feature != "base" for n in u.writes(cfg=True)}) - base_values
    split_line = next(line for line in log.splitlines() if line.startswith("split: "))
    assert "features: base\n" in log
    assert not [u for u in feature_units if u in split_line], split_line
    manifest = json.loads((tmp_path / "cache" / "manifest.json").read_text())
    index = json.loads(next((tmp_path / "cache").glob("part-*/shard-*.json")).read_text())
    cached = set(manifest["frontier"]) | {n for s in index["samples"].values() for n in s}
    assert not cached & feature_values, cached & feature_values
    assert all(u.split("@")[0] not in feature_units for u in manifest["fingerprint"]["units"])

    built = []
    real = models_pkg.load_component
    monkeypatch.setattr(models_pkg, "load_component",
                        lambda config, *a, **k: built.append(real(config, *a, **k)) or built[-1])
    run_train("--task", "sft:train", "--dataset_base_path", tmp_path / "cache", "--output_path", tmp_path / "two",
              *flags(tiny, *case_flags))
    from conftest import setup_run

    split = setup_run("--dataset_base_path", tiny.metadata.parent, "--dataset_metadata_path", tiny.metadata,
                      *flags(tiny, *case_flags)).split
    assert sorted(c.name for c in built) == sorted(set(split.stage2_models) - set(tiny.optional_slots))
    assert set(split.stage1_models) - set(split.stage2_models)  # there was something to leave out
