"""The reference's Wan scripts are acceptance tests: every script in tests/reference_scripts/wanvideo/model_training/
(DiffSynth-Studio fed7b18, see SOURCE.md) is read with only `accelerate launch .../train.py` replaced by
`difftune train` and resolved (models recognised, features, split: `support.scripts.resolve_scripts`); the first of
each distinct configuration runs with `--max_steps 2` appended, in one tiny workspace laid out as the scripts name their files
(`support.write_wan_script_workspace`: Wan-AI's, PAI's, iic's and krea's original layouts, one-sample data
sets of one-frame clips, five frames where a script reads a first and a last frame, moves a camera or animates). The scripts' --height 480 --width 832 and frame counts are kept (the clips are resized; the
4k+1 rule cuts them). Each command must leave what it is for: a complete stage-1 cache, or a checkpoint holding
what it trained (a LoRA of the named model at the named rank that moved; a fully trained model's own keys, changed).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from difftune.cli.main import main as difftune
from support import read_reference_script, write_wan_script_workspace
from support.scripts import at_small_size, flag_value, resolve_scripts, trains_end_to_end

SCRIPTS = Path(__file__).resolve().parents[2] / "reference_scripts" / "wanvideo" / "model_training"
WAN_SCRIPTS = sorted(str(p.relative_to(SCRIPTS)) for p in SCRIPTS.rglob("*.sh"))
# S2V and the audio path, Wan-Dancer, LongCat-Video, Video-As-Prompt: their scripts run in test_reference_scripts_b.py
# (a workspace of their own)
PART_B = {f"{kind}/{name}.sh" for kind in ("lora", "full") for name in (
    "Wan2.2-S2V-14B", "Wan-Dancer-14B-global", "Wan-Dancer-14B-local", "LongCat-Video", "Video-As-Prompt-Wan2.1-14B")}
# What a script needs besides its own commands, and why.
BEFORE = {
    # Its second command reads ./models/train/Wan2.1-I2V-14B-480P_lora_split_cache, the cache the split-training
    # script's first command writes (its own first command writes ..._lora_lowvram_cache): as in the reference,
    # that cache must exist first.
    "special/low_vram_training/Wan2.1-I2V-14B-480P.sh": ("special/split_training/Wan2.1-I2V-14B-480P.sh", 0),
}


def test_the_snapshot_holds_all_77_wan_scripts():
    assert len(WAN_SCRIPTS) == 77 and PART_B <= set(WAN_SCRIPTS)
    assert all(read_reference_script(SCRIPTS / s).commands for s in WAN_SCRIPTS)


COVERED_SCRIPTS = {f"wanvideo/model_training/{s}" for s in WAN_SCRIPTS if s not in PART_B}  # test_reference_coverage


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    """Bare original files are recognised against the official configs: the tiny ones are added for the module."""
    root, known = write_wan_script_workspace(tmp_path_factory.mktemp("wan_scripts"))
    with pytest.MonkeyPatch.context() as patch:
        for spec, label, config in known:
            patch.setitem(spec.known_configs, label, config)
        yield root


def _run(argv: list[str], capsys) -> str:
    code = difftune([*at_small_size(argv), "--max_steps", "2", "--no_progress"])
    out = capsys.readouterr()
    assert code == 0, f"`difftune {' '.join(argv[:1])} ...` exited {code}: {out.err.strip()[-2000:]}"
    return out.out + out.err


def _base_model(argv: list[str], slot: str) -> dict[str, torch.Tensor]:
    """The state dict of `slot` as the command's weights give it (our loader, before training)."""
    from difftune.core.family import recognise
    from difftune.models import load_component, parse_model_configs

    configs = parse_model_configs(flag_value(argv, "--model_paths"), flag_value(argv, "--model_id_with_origin_paths"))
    spec, found = recognise(configs, log=lambda *a: None)
    config, detected = next((c, d) for s, c, d in found if s == slot)
    return load_component(config, spec.components, torch_dtype=torch.float32, detected=detected).module.state_dict()


def _check_checkpoint(argv: list[str]) -> None:
    out = Path(flag_value(argv, "--output_path"))
    files = sorted(out.glob("*.safetensors"))
    assert files, f"no checkpoint in {out}"
    saved = load_file(str(files[-1]))
    lora_model = flag_value(argv, "--lora_base_model")
    if lora_model:
        rank = int(flag_value(argv, "--lora_rank") or 32)
        a = [v for k, v in saved.items() if k.endswith(".lora_A.weight")]
        assert a and all(t.shape[0] == rank for t in a), "LoRA rank"
        # the DiT's LoRA in Wan's default layout (Wan's own module names under diffusion_model., what ComfyUI and the
        # reference's loader read); another model's (VACE's branch) in diffusers' layout under the transformer
        prefix = "diffusion_model." if lora_model == "dit" and "Animate-2" not in flag_value(argv, "--output_path") \
            else "transformer."
        assert all(k.startswith(prefix) for k in saved), f"LoRA keys not under {prefix}: {sorted(saved)[:3]}"
        assert any(v.abs().max() > 0 for k, v in saved.items() if ".lora_B." in k), "the LoRA did not train"
        return
    slot = flag_value(argv, "--trainable_models").split(",")[0].split(".")[0]
    base = _base_model(argv, slot)
    assert saved and set(saved) <= set(base), f"keys not of {slot}: {sorted(set(saved) - set(base))[:3]}"
    assert any(not torch.equal(saved[k].float(), base[k].float()) for k in saved), f"{slot} did not train"


@pytest.fixture(scope="module")
def configurations(workspace):
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(workspace)
        patch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "true")
        return resolve_scripts(SCRIPTS, [s for s in WAN_SCRIPTS if s not in PART_B], before=BEFORE)


@pytest.mark.slow
@pytest.mark.parametrize("script", [s for s in WAN_SCRIPTS if s not in PART_B])
def test_reference_script_runs(script, workspace, configurations, monkeypatch, capsys):
    if not trains_end_to_end(script, configurations):
        return  # resolved as an earlier script of its configuration did, which trained
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "true")
    if script in BEFORE:
        other, index = BEFORE[script]
        argv = read_reference_script(SCRIPTS / other).commands[index]
        if not any(Path(flag_value(argv, "--output_path")).rglob("complete.json")):
            _run(argv, capsys)
    for argv in read_reference_script(SCRIPTS / script).commands:
        _run(argv, capsys)
        if (flag_value(argv, "--task") or "").endswith("data_process"):
            assert any(Path(flag_value(argv, "--output_path")).rglob("complete.json")), f"{script}: no cache"
        else:
            _check_checkpoint(argv)


# -- a variant's extra inputs change what trains -----------------------------------------------------------------
# One script per variant (its LoRA command), and each input changed alone on a copy of its data set: the trained
# LoRA must differ from the script's own run.
INPUT_CHANGES = [("lora/Wan2.1-VACE-1.3B.sh", "vace_video"), ("lora/Wan2.1-VACE-1.3B.sh", "vace_reference_image"),
                 ("lora/Wan2.1-Fun-V1.1-1.3B-Control.sh", "control_video"),
                 ("lora/Wan2.1-Fun-V1.1-1.3B-Control.sh", "reference_image"),
                 ("lora/Wan2.1-Fun-V1.1-1.3B-Control-Camera.sh", "camera_control_direction"),
                 ("lora/Wan2.2-Animate-14B.sh", "animate_pose_video"),
                 ("lora/Wan2.2-Animate-14B.sh", "animate_face_video"),
                 ("lora/Wan2.1-1.3b-speedcontrol-v1.sh", "motion_bucket_id")]


def _changed(folder: Path, column: str, value: str) -> str:
    """Another value of `column`: another clip (as many frames, as large), another picture, another number or
    direction."""
    from PIL import Image, ImageOps

    from difftune.media.video import probe_video, read_video, write_video

    if value.endswith(".mp4"):  # the same clip with its colours inverted and its frames in reverse
        frames = [ImageOps.invert(f.convert("RGB")) for f in read_video(folder / value)][::-1]
        write_video(frames, folder / f"other_{value}", fps=probe_video(folder / value).fps or 16)
        return f"other_{value}"
    if value.endswith(".png"):
        with Image.open(folder / value) as image:
            ImageOps.invert(image.convert("RGB")).save(folder / f"other_{value}")
        return f"other_{value}"
    if column == "camera_control_direction":
        return "RightDown" if value != "RightDown" else "LeftUp"
    return str(int(value) + 40)


@pytest.mark.slow
@pytest.mark.parametrize("script,column", INPUT_CHANGES)
def test_changing_an_extra_input_changes_the_trained_lora(script, column, workspace, monkeypatch, capsys, tmp_path):
    import csv
    import shutil

    monkeypatch.chdir(workspace)
    monkeypatch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "true")
    (argv,) = read_reference_script(SCRIPTS / script).commands
    assert column in flag_value(argv, "--extra_inputs").split(",")
    source = Path(flag_value(argv, "--dataset_base_path"))
    folder = tmp_path / "data"
    shutil.copytree(source, folder)
    meta = folder / Path(flag_value(argv, "--dataset_metadata_path")).name
    with meta.open() as f:
        rows = list(csv.DictReader(f))
    for row in rows:
        row[column] = _changed(folder, column, row[column])
    with meta.open("w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0]))
        writer.writeheader()
        writer.writerows(rows)

    def with_(values):
        out = list(argv)
        for flag, value in values.items():
            out[out.index(flag) + 1] = str(value)
        return out

    # the script's own run (left in the workspace by test_reference_script_runs, or by the first column tried) is
    # the one to differ from
    same = Path(flag_value(argv, "--output_path"))
    if not any(same.glob("*.safetensors")):
        _run(argv, capsys)
    _run(with_({"--dataset_base_path": folder, "--dataset_metadata_path": meta, "--output_path": tmp_path / "changed"}),
         capsys)
    a, b = (load_file(str(sorted(out.glob("*.safetensors"))[-1])) for out in (same, tmp_path / "changed"))
    assert a.keys() == b.keys() and a
    diff = max((a[k].float() - b[k].float()).abs().max().item() for k in a)
    assert diff > 1e-7, f"{script}: changing {column} left the LoRA as it was"
