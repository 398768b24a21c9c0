"""Every FLUX.1 script of the reference (tests/reference_scripts/flux/model_training/{lora,full,special}, 33 scripts)
read with only `accelerate launch [...] examples/flux/model_training/train.py` replaced by `difftune train`, in one
tiny workspace (`write_flux_script_workspace`: every hub file the scripts name, in its release's layout, under
./models; every data set under ./data/diffsynth_example_dataset/flux): each is resolved (models recognised, features,
split: `support.scripts.resolve_scripts`), and the first of each distinct configuration runs with `--max_steps 2`
appended. Each run asserts its checkpoint; a script with extra inputs is run again on a copy of its data whose extra
inputs differ, and trains something else. InfiniteYou's two scripts are refused in one line (InsightFace's face embedder is not installed) and
run with a precomputed face-embedding column instead. Plus the two-stage form of the FLUX.1-dev command."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image, ImageOps
from safetensors.torch import load_file, save_file

from difftune.cli.main import main as difftune
from support.scripts import at_small_size, flag_value, reference_commands, resolve_scripts, trains_end_to_end

ROOT = Path(__file__).resolve().parents[2] / "reference_scripts" / "flux" / "model_training"
SCRIPTS = sorted(p.relative_to(ROOT).as_posix() for p in ROOT.rglob("*.sh"))
COVERED_SCRIPTS = {f"flux/model_training/{s}" for s in SCRIPTS}  # tests/test_reference_coverage.py
# what InfiniteYou's face embedding needs and this machine lacks
REFUSED = {"lora/FLUX.1-dev-InfiniteYou.sh": "insightface", "full/FLUX.1-dev-InfiniteYou.sh": "insightface"}
# a key of each fully trained model (its slot's names); saved as `pipe.<slot>.<key>` minus --remove_prefix_in_ckpt, the
# released names where the reference's scripts remove the slot's own prefix
FULL_KEYS = {"dit": "transformer_blocks.0.attn.to_q.weight", "controlnet": "models.0.controlnet_x_embedder.weight",
             "ipadapter": "ip_adapter.0.to_k_ip.weight", "value_controller": "encoders.0.positional_embedding",
             "lora_encoder": "special_embeds", "image_proj_model": "latents"}


def test_the_snapshot_has_every_flux_script():
    assert len(SCRIPTS) == 33
    (dev,) = reference_commands(ROOT / "lora" / "FLUX.1-dev.sh")
    assert dev[:3] == ["train", "--dataset_base_path", "data/diffsynth_example_dataset/flux/FLUX.1-dev"]
    assert dev[-2:] == ["--align_to_opensource_format", "--use_gradient_checkpointing"]


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from support import write_flux_script_workspace

    return write_flux_script_workspace(tmp_path_factory.mktemp("flux_scripts"))


@pytest.fixture(scope="module")
def configurations(workspace):
    from support import tiny_known_configs

    with pytest.MonkeyPatch.context() as patch:
        for spec, label, config in tiny_known_configs(workspace):
            patch.setitem(spec.known_configs, label, config)
        patch.chdir(workspace)
        patch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "true")
        return resolve_scripts(ROOT, SCRIPTS)


@pytest.fixture()
def in_workspace(workspace, monkeypatch):
    from support import tiny_known_configs

    # bare single files carry no config: the tiny files' configs stand in for the releases' known ones
    for spec, label, config in tiny_known_configs(workspace):
        monkeypatch.setitem(spec.known_configs, label, config)
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "true")
    return workspace


def _checkpoint(output: str) -> dict[str, torch.Tensor]:
    """The last checkpoint (all its files: one per fully trained model when there are several)."""
    files = sorted(Path(output).glob("*.safetensors"), key=lambda p: p.stat().st_mtime)
    assert files, f"no checkpoint in {output}"
    last = files[-1].name.split("-")[:2]
    return {k: v for f in files if f.name.split("-")[:2] == last for k, v in load_file(str(f)).items()}


def _run(argv, *more) -> dict[str, torch.Tensor]:
    assert difftune([*at_small_size(argv), *more, "--max_steps", "2", "--no_progress"]) == 0
    return _checkpoint(flag_value([*argv, *more], "--output_path"))


def _assert_checkpoint(argv, saved):
    trainable = flag_value(argv, "--trainable_models")
    if trainable is None and "--align_to_opensource_format" in argv:
        # the reference's kohya file: BFL's fused names, an alpha per layer
        assert all(k.startswith("lora_unet_") for k in saved)
        # one adapter on the fused q, k, v, of the reference's rank (three of rank 32 stacked before)
        assert saved["lora_unet_double_blocks_0_img_attn_qkv.lora_down.weight"].shape[0] == 32
        assert saved["lora_unet_single_blocks_0_linear1.lora_down.weight"].shape[0] == 32  # q, k, v, MLP: one too
        assert any(v.abs().max() > 0 for k, v in saved.items() if ".lora_up." in k)  # it trained
        return
    if trainable is None:  # a DiT LoRA: the reference's fused target names on diffusers' modules
        assert all(k.startswith("transformer.") for k in saved)
        for module in ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.add_v_proj",
                       "single_transformer_blocks.0.proj_mlp"):
            assert saved[f"transformer.{module}.lora_A.weight"].shape[0] == 32  # --lora_rank 32
        assert any(v.abs().max() > 0 for k, v in saved.items() if ".lora_B." in k)  # it trained
        return
    prefix = flag_value(argv, "--remove_prefix_in_ckpt")
    for slot in trainable.split(","):
        key = f"pipe.{slot}.{FULL_KEYS[slot]}"
        assert key.removeprefix(prefix) in saved, (key, prefix, sorted(saved)[:5])


def _extra_inputs(argv) -> list[str]:
    value = flag_value(argv, "--extra_inputs")
    return value.split(",") if value else []


def _other(value, column: str, folder: Path):
    """A different value of an extra input (files rewritten in `folder`, a copy of the data set)."""
    if isinstance(value, list):
        return [_other(v, column, folder) for v in value]
    if isinstance(value, (int, float)):
        return value + 0.3
    if column == "controlnet_processor_id":
        return {"canny": "tile", "depth": "pose"}[value]
    if column == "eligen_entity_prompts":
        return value[::-1]
    path = folder / value if (folder / value).is_file() else Path(value)
    if value.endswith(".png"):
        with Image.open(path) as image:
            ImageOps.mirror(ImageOps.invert(image.convert("RGB"))).save(path)
        return value
    new = folder / (path.stem + "_other" + path.suffix)
    if value.endswith(".npy"):
        np.save(new, -np.load(path))
    else:  # a LoRA file
        save_file({k: v * 3 for k, v in load_file(str(path)).items()}, str(new))
    return new.as_posix()


def _changed_data(argv, root: Path) -> list[str]:
    """A copy of the script's data set whose extra inputs differ; the flags that point at it."""
    folder = Path(flag_value(argv, "--dataset_base_path"))
    meta = Path(flag_value(argv, "--dataset_metadata_path"))
    copy = root / "changed" / folder.name
    shutil.rmtree(copy, ignore_errors=True)
    shutil.copytree(folder, copy)
    if meta.suffix == ".json":
        rows = json.loads(meta.read_text())
    else:
        import csv

        rows = list(csv.DictReader(meta.open()))
    for row in rows:
        for column in _extra_inputs(argv):
            value = row[column]
            if isinstance(value, str) and value.startswith("["):
                value = json.loads(value)
            elif isinstance(value, str) and value.replace(".", "", 1).isdigit():
                value = float(value)
            row[column] = _other(value, column, copy)
    if meta.suffix == ".json":
        (copy / meta.name).write_text(json.dumps(rows))
    else:
        cols = list(rows[0])
        lines = [",".join(cols)] + [",".join(f'"{r[c]}"' for c in cols) for r in rows]
        (copy / meta.name).write_text("\n".join(lines) + "\n")
    return ["--dataset_base_path", str(copy), "--dataset_metadata_path", str(copy / meta.name),
            "--output_path", str(root / "changed_out" / folder.name)]


def _max_difference(a, b) -> float:
    assert a.keys() == b.keys() and a
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.slow
@pytest.mark.parametrize("script", SCRIPTS)
def test_reference_script_runs_with_only_the_script_path_replaced(in_workspace, configurations, script, capsys):
    (argv,) = reference_commands(ROOT / script)
    if not trains_end_to_end(script, configurations):
        return  # resolved as an earlier script of its configuration did, which trained
    if script in REFUSED:
        assert difftune([*argv, "--max_steps", "2", "--no_progress"]) != 0
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and REFUSED[script] in err[0] and "infinityou_face_embedding" in err[0], err
        # the same command on precomputed face embeddings (metadata_embedding.csv: infinityou_face_embedding)
        argv = [a.replace("infinityou_id_image", "infinityou_face_embedding") if i and argv[i - 1] == "--extra_inputs"
                else a.replace(",infinityou_id_image", "") if i and argv[i - 1] == "--data_file_keys"
                else a.replace("metadata.csv", "metadata_embedding.csv") if i and
                argv[i - 1] == "--dataset_metadata_path" else a for i, a in enumerate(argv)]
    saved = _run(argv)
    _assert_checkpoint(argv, saved)
    if _extra_inputs(argv):  # other extra inputs, another result
        other = _run(argv, *_changed_data(argv, in_workspace))
        assert _max_difference(saved, other) > 1e-7, script


@pytest.mark.slow
def test_two_stage_form_of_the_dev_command(in_workspace):
    """The dev command split as the reference's split_training scripts do: stage 1 with the encoders (no DiT),
    `--dataset_repeat 1`, `--task sft:data_process`; stage 2 from the cache with the DiT alone, `--task sft:train`.
    It trains what the one-stage command trains (bf16 weights, as the reference's default: within bf16 rounding)."""
    (argv,) = reference_commands(ROOT / "lora" / "FLUX.1-dev.sh")
    models = flag_value(argv, "--model_id_with_origin_paths").split(",")
    dit = [m for m in models if m.endswith("flux1-dev.safetensors")]
    assert len(dit) == 1

    def edit(argv, **changes):
        out = list(argv)
        for name, value in changes.items():
            i = out.index(f"--{name}")
            if value is None:
                del out[i:i + 2]
            else:
                out[i + 1] = value
        return out

    one = edit([*argv, "--max_steps", "2", "--no_progress"], output_path="./models/train/FLUX.1-dev-LoRA-one")
    stage1 = edit(one, model_id_with_origin_paths=",".join(m for m in models if m not in dit), dataset_repeat="1",
                  output_path="./models/train/FLUX.1-dev-LoRA-splited-cache") + ["--task", "sft:data_process"]
    stage2 = edit(one, model_id_with_origin_paths=dit[0], dataset_metadata_path=None,
                  dataset_base_path="./models/train/FLUX.1-dev-LoRA-splited-cache",
                  output_path="./models/train/FLUX.1-dev-LoRA-splited") + ["--task", "sft:train"]
    assert difftune(one) == 0
    assert difftune(stage1) == 0
    assert difftune(stage2) == 0
    a, b = _checkpoint("./models/train/FLUX.1-dev-LoRA-one"), _checkpoint("./models/train/FLUX.1-dev-LoRA-splited")
    assert any(v.abs().max() > 0 for k, v in b.items() if ".lora_B." in k or ".lora_up." in k)  # stage 2 trained
    diff = _max_difference(a, b)
    print(f"flux dev command: one-stage vs two-stage max LoRA difference {diff:.2e}")
    assert diff < 1e-3
