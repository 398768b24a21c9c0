"""The reference's S2V, Wan-Dancer (global / local), LongCat-Video and Video-As-Prompt scripts (10, under
tests/reference_scripts/wanvideo/model_training/{lora,full}/) run with only `accelerate launch .../train.py` replaced
by `difftune train` and `--max_steps 2` appended, on tiny models laid out where the scripts look and 5-frame data
sets (one shared workspace); and, for each script's extra inputs, changing that input changes what trains.

The Wan-Dancer scripts need librosa (the music features: difftune[audio]) and are skipped without it."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from difftune.cli.main import main as difftune
from difftune.families.wan.dancer.units import has_librosa
from support import read_reference_script
from support.scripts import at_small_size, flag_value

SCRIPTS = Path(__file__).resolve().parents[2] / "reference_scripts" / "wanvideo" / "model_training"
needs_librosa = pytest.mark.skipif(not has_librosa(), reason="Wan-Dancer's music features need librosa "
                                                             "(difftune[audio])")
DANCER = [pytest.param(s, marks=needs_librosa) for s in (
    "lora/Wan-Dancer-14B-global.sh", "lora/Wan-Dancer-14B-local.sh", "full/Wan-Dancer-14B-global.sh",
    "full/Wan-Dancer-14B-local.sh")]
COVERED_SCRIPTS = {f"wanvideo/model_training/{kind}/{name}.sh" for kind in ("lora", "full") for name in (
    "Wan2.2-S2V-14B", "Wan-Dancer-14B-global", "Wan-Dancer-14B-local", "LongCat-Video",
    "Video-As-Prompt-Wan2.1-14B")}  # tests/test_reference_coverage.py


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    from support.wan.scripts_b import write_wan_b_workspace

    return write_wan_b_workspace(tmp_path_factory.mktemp("wan_b_scripts"))


@pytest.fixture()
def in_workspace(workspace, monkeypatch):
    """Bare Wan-AI .pth files are matched against the official configs: the tiny ones stand in for them."""
    from difftune.families.wan.components import IMAGE_ENCODER_ORIGINAL, TEXT_ENCODER_ORIGINAL, VAE_ORIGINAL

    root, configs = workspace
    monkeypatch.setitem(TEXT_ENCODER_ORIGINAL.known_configs, "tiny", configs["text_encoder"])
    monkeypatch.setitem(VAE_ORIGINAL.known_configs, "tiny", configs["vae"])
    monkeypatch.setitem(IMAGE_ENCODER_ORIGINAL.known_configs, "tiny", configs["image_encoder"])
    monkeypatch.chdir(root)
    monkeypatch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "true")
    return root


def _run(argv, capsys) -> str:
    start = time.perf_counter()
    # 64x32: Wan-Dancer's music rows (8 per latent frame) must divide a latent frame's tokens
    code = difftune([*at_small_size([*map(str, argv)], 64, 32), "--max_steps", "2", "--no_progress"])
    out = capsys.readouterr()
    assert code == 0, f"`difftune {' '.join(map(str, argv))}` exited {code}: {out.err.strip()[-2000:]}"
    print(f"{flag_value(list(map(str, argv)), '--output_path')}: {time.perf_counter() - start:.1f} s")
    return out.out + out.err


def _checkpoint(argv) -> dict[str, torch.Tensor]:
    files = sorted(Path(flag_value(argv, "--output_path")).glob("*.safetensors"))
    assert files, f"no checkpoint in {flag_value(argv, '--output_path')}"
    return load_file(str(files[-1]))


def _command(script: str) -> list[str]:
    (argv,) = read_reference_script(SCRIPTS / script).commands
    return argv


# what each LoRA checkpoint must hold: (a key, its rank dimension), in the model's own module names
LORA_KEYS = {
    "Wan2.2-S2V-14B": ["transformer.blocks.0.self_attn.q.lora_A.weight", "transformer.blocks.1.ffn.2.lora_A.weight"],
    "Wan-Dancer-14B-global": ["transformer.blocks.0.attn1.to_q.lora_A.weight",
                              "transformer.music_injector.injector.0.q.lora_A.weight"],
    "Wan-Dancer-14B-local": ["transformer.blocks.0.attn1.to_q.lora_A.weight",
                             "transformer.music_injector.injector.1.o.lora_A.weight"],
    "LongCat-Video": ["transformer.blocks.0.attn.qkv.lora_A.weight", "transformer.blocks.1.ffn.w3.lora_A.weight",
                      "transformer.blocks.0.adaLN_modulation.1.lora_A.weight"],
    "Video-As-Prompt-Wan2.1-14B": ["transformer.blocks.0.attn1.to_q.lora_A.weight",
                                   "transformer.blocks.1.ffn.net.2.lora_A.weight"],
}


def _assert_lora(name: str, lora: dict[str, torch.Tensor]) -> None:
    for key in LORA_KEYS[name]:
        assert key in lora and lora[key].shape[0] == 32, (name, key)
    assert all(k.startswith("transformer.") for k in lora)
    assert any(v.abs().max() > 0 for k, v in lora.items() if ".lora_B." in k)  # it trained


@pytest.mark.slow
@pytest.mark.parametrize("script", ["lora/Wan2.2-S2V-14B.sh", "lora/LongCat-Video.sh",
                                    "lora/Video-As-Prompt-Wan2.1-14B.sh", *DANCER[:2]])
def test_lora_script_trains(in_workspace, script, capsys):
    argv = _command(script)
    _run(argv, capsys)
    _assert_lora(Path(script).stem, _checkpoint(argv))


# full training: the model each script trains, in its own key names (the reference's prefix removed)
FULL = {"Wan2.2-S2V-14B": ("casual_audio_encoder.weights", "blocks.0.self_attn.q.weight"),
        "Wan-Dancer-14B-global": ("music_projection.weight", "patch_embedding_global.weight"),
        "Wan-Dancer-14B-local": ("music_projection.weight", "blocks.0.attn1.to_q.weight"),
        "LongCat-Video": ("x_embedder.proj.weight", "blocks.0.attn.qkv.weight"),
        "Video-As-Prompt-Wan2.1-14B": ("blocks.0.self_attn.q.weight", "img_emb.proj.1.weight")}


@pytest.mark.slow
@pytest.mark.parametrize("script", ["full/Wan2.2-S2V-14B.sh", "full/LongCat-Video.sh",
                                    "full/Video-As-Prompt-Wan2.1-14B.sh", *DANCER[2:]])
def test_full_script_trains(in_workspace, script, capsys):
    from difftune.core.build import build_pipeline
    from difftune.core.family import get_family
    from difftune.models import parse_model_configs

    argv = _command(script)
    _run(argv, capsys)
    trained = _checkpoint(argv)
    name = Path(script).stem
    assert all(k in trained for k in FULL[name]), sorted(trained)[:5]
    slot = "vap" if name.startswith("Video-As-Prompt") else "dit"
    configs = parse_model_configs(None, flag_value(argv, "--model_id_with_origin_paths"))
    pipe = build_pipeline(get_family("wan"), configs, torch_dtype=torch.float32, wanted={slot}, log=lambda *a: None)
    before = pipe.models[slot].state_dict()
    assert trained.keys() == before.keys()  # the whole model, nothing else
    assert any(not torch.equal(trained[k].float(), before[k].float()) for k in before)  # it trained


# -- each extra input changes what trains -------------------------------------------------------------------------

def _variant_run(argv, root: Path, name: str, change, capsys) -> dict[str, torch.Tensor]:
    """The script's command on a copy of its data set with `change(folder, rows)` applied to the metadata rows."""
    source = Path(flag_value(argv, "--dataset_base_path"))
    folder = root / "changed" / name
    shutil.rmtree(folder, ignore_errors=True)
    shutil.copytree(source, folder)
    meta = folder / Path(flag_value(argv, "--dataset_metadata_path")).name
    rows = json.loads(meta.read_text()) if meta.suffix == ".json" else _read_csv(meta)
    change(folder, rows)
    if meta.suffix == ".json":
        meta.write_text(json.dumps(rows))
    else:
        _write_csv(meta, rows)
    new = _replace(argv, {"--dataset_base_path": folder, "--dataset_metadata_path": meta,
                          "--output_path": root / "changed_out" / name})
    _run(new, capsys)
    return _checkpoint(new)


def _replace(argv, values):
    out = list(argv)
    for flag, value in values.items():
        out[out.index(flag) + 1] = str(value)
    return out


def _read_csv(path):
    import csv

    with path.open() as f:
        return list(csv.DictReader(f))


def _write_csv(path, rows):
    import csv

    names = list(dict.fromkeys(k for r in rows for k in r))
    with path.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=names)
        writer.writeheader()
        writer.writerows(rows)


def _differs(a, b) -> float:
    assert a.keys() == b.keys()
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _swap(column):
    """Each row takes the next row's file for `column`."""
    def change(folder, rows):
        values = [r[column] for r in rows]
        for r, v in zip(rows, values[1:] + values[:1]):
            r[column] = v
    return change


def _other_image(column):
    """`column` as an image file of its own (a still of another colour), where the script takes a clip's frame."""
    def change(folder, rows):
        from PIL import Image

        for i, r in enumerate(rows):
            Image.new("RGB", (64, 32), (10 + 100 * i, 200, 90)).save(folder / f"{column}_{i}.png")
            r[column] = f"{column}_{i}.png"
    return change


def _set(column, value):
    def change(folder, rows):
        for r in rows:
            r[column] = value(r) if callable(value) else value
    return change


def _baseline(in_workspace, script, capsys):
    argv = _command(script)
    out = Path(flag_value(argv, "--output_path"))
    if not any(out.glob("*.safetensors")):
        _run(argv, capsys)
    return argv, _checkpoint(argv)


@pytest.mark.slow
@pytest.mark.parametrize("column, change", [("input_audio", _swap("input_audio")),
                                            ("s2v_pose_video", _swap("s2v_pose_video")),
                                            ("input_image", _other_image("input_image"))])
def test_s2v_inputs_change_the_result(in_workspace, column, change, capsys):
    argv, base = _baseline(in_workspace, "lora/Wan2.2-S2V-14B.sh", capsys)
    assert _differs(base, _variant_run(argv, in_workspace, f"s2v_{column}", change, capsys)) > 1e-7, column


@pytest.mark.slow
@pytest.mark.parametrize("column, change", [("vap_video", _swap("vap_video")),
                                            ("input_image", _other_image("input_image"))])
def test_vap_inputs_change_the_result(in_workspace, column, change, capsys):
    argv, base = _baseline(in_workspace, "lora/Video-As-Prompt-Wan2.1-14B.sh", capsys)
    assert _differs(base, _variant_run(argv, in_workspace, f"vap_{column}", change, capsys)) > 1e-7, column


@pytest.mark.slow
@needs_librosa
@pytest.mark.parametrize("column, change", [
    ("wantodance_music_path", _swap("wantodance_music_path")),
    ("wantodance_reference_image", _swap("wantodance_reference_image")),
    ("wantodance_fps", _set("wantodance_fps", 15)),
    ("wantodance_keyframes", _swap("wantodance_keyframes")),
    ("wantodance_keyframes_mask", _set("wantodance_keyframes_mask",
                                       lambda r: [1] * len(r["wantodance_keyframes_mask"])))])
def test_dancer_inputs_change_the_result(in_workspace, column, change, capsys):
    """On the global script (its framewise_decoding rows against the local script's are the two scripts above)."""
    argv, base = _baseline(in_workspace, "lora/Wan-Dancer-14B-global.sh", capsys)
    changed = _variant_run(argv, in_workspace, f"dancer_{column}", change, capsys)
    assert _differs(base, changed) > 1e-7, column
