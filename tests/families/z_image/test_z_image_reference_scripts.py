"""The reference's Z-Image scripts (tests/reference_scripts/z_image/model_training/, all 17) with only
`accelerate launch examples/z_image/model_training/train.py` replaced by `difftune train`, on tiny models laid out
under ./models at the hub ids they name and tiny data sets where they look (`support.write_z_image_script_workspace`).
Each is resolved (models recognised, features, split: `support.scripts.resolve_scripts`); the first of each distinct
configuration runs with `--max_steps 2` appended and must leave its checkpoint, in the layout its user loads;
ZImage-i2L-v2.sh (Diffusion Templates) is refused in one line. The Omni-Base scripts' commented image(s)-to-image
commands run too."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from difftune.cli.main import main as difftune
from support.z_image import CONTROLNET_REPO, write_z_image_script_workspace
from support import read_reference_script
from support.lora_presets import check_merge, record_merges
from support.scripts import at_small_size, flag_value, resolve_scripts, trains_end_to_end

SCRIPTS = Path(__file__).resolve().parents[2] / "reference_scripts" / "z_image" / "model_training"
ALL = sorted(str(p.relative_to(SCRIPTS)) for p in SCRIPTS.rglob("*.sh"))
REFUSED = {"full/ZImage-i2L-v2.sh": "--template_model_id_or_path"}
RUNNING = [s for s in ALL if s not in REFUSED]
COVERED_SCRIPTS = {f"z_image/model_training/{s}" for s in ALL}  # tests/test_reference_coverage.py


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return write_z_image_script_workspace(tmp_path_factory.mktemp("z_image_scripts"))


@pytest.fixture(scope="module")
def configurations(workspace):
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(workspace)
        patch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "true")
        return resolve_scripts(SCRIPTS, RUNNING)


@pytest.fixture()
def in_workspace(workspace, monkeypatch):
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "true")
    return workspace


def test_the_snapshot_has_all_17_scripts():
    assert len(ALL) == 17 and all(read_reference_script(SCRIPTS / s).commands for s in ALL)


def _run(argv, capsys) -> str:
    code = difftune([*at_small_size(argv), "--max_steps", "2", "--no_progress"])
    out = capsys.readouterr()
    assert code == 0, f"`difftune {' '.join(argv)}` exited {code}: {out.err.strip()[-2000:]}"
    return out.out + out.err


def _checkpoints(argv) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in Path(flag_value(argv, "--output_path")).glob("*.safetensors")}


def _check_checkpoint(argv, workspace, before: dict[Path, int]) -> dict:
    """The checkpoint this run wrote (lora/Z-Image-Turbo.sh's folder also holds the LoRA the trajectory-imitation
    script starts from; the NPU script writes where full/Z-Image-Turbo.sh does)."""
    files = sorted(p for p, t in _checkpoints(argv).items() if before.get(p) != t)
    assert files, f"no checkpoint in {flag_value(argv, '--output_path')}"
    saved = load_file(str(files[-1]))
    if flag_value(argv, "--lora_base_model"):
        # the reference's targets on diffusers' modules, in the default (comfyui) layout, at the script's rank
        assert all(k.startswith("diffusion_model.") for k in saved)
        for module in ("attention.to_q", "attention.to_out.0", "feed_forward.w1", "feed_forward.w3"):
            key = f"diffusion_model.layers.0.{module}.lora_A.weight"
            assert key in saved and saved[key].shape[0] == int(flag_value(argv, "--lora_rank")), key
        assert any(v.abs().max() > 0 for k, v in saved.items() if ".lora_B." in k)
    elif flag_value(argv, "--trainable_models") == "controlnet":
        entry = next(e for e in flag_value(argv, "--model_id_with_origin_paths").split(",") if CONTROLNET_REPO in e)
        released = load_file(str(workspace / "models" / CONTROLNET_REPO / entry.split(":")[1]))
        assert saved.keys() == released.keys()  # the released file's own key names: it loads where that one does
        assert any(not torch.equal(saved[k].float(), released[k].float()) for k in saved)
    else:
        assert "x_pad_token" in saved and "layers.0.feed_forward.w1.weight" in saved  # the DiT, prefix removed
    return saved


@pytest.mark.slow
@pytest.mark.parametrize("script", RUNNING)
def test_reference_script_runs(in_workspace, configurations, script, capsys, monkeypatch):
    from difftune.models import quant

    if not trains_end_to_end(script, configurations):  # resolved as an earlier script of its configuration, which trained
        if "npu_training" in script:
            assert "note: --enable_npu_patch" in configurations[script].log
        return

    quantised = []
    real = quant.quantize_linears
    monkeypatch.setattr(quant, "quantize_linears", lambda module, option, **kw: quantised.append(
        (type(module).__name__, option.method)) or real(module, option, **kw))
    (argv,) = read_reference_script(SCRIPTS / script).commands
    before = _checkpoints(argv)
    merges = record_merges(monkeypatch)
    log = _run(argv, capsys)
    saved = _check_checkpoint(argv, in_workspace, before)
    if flag_value(argv, "--preset_lora_path"):  # the differential script: ostris' adapter merged into the DiT
        assert check_merge(merges, in_workspace / flag_value(argv, "--preset_lora_path")) > 0
    if "npu_training" in script:
        assert "note: --enable_npu_patch" in log
    if "trajectory_imitation" in script:
        # it continued from the reference-layout LoRA the script names (rank 32), not from zero
        start = load_file(str(in_workspace / "models" / "train" / "Z-Image-Turbo_lora" / "epoch-4.safetensors"))
        key = "layers.0.attention.to_q.lora_B"
        assert (saved[f"diffusion_model.{key}.weight"] - start[f"{key}.default.weight"]).abs().max() < 1e-2
    if "quant_training" in script:  # the DiT and the text encoder in NF4, the LoRA on the 4-bit DiT
        assert sorted(quantised) == [("Qwen3Model", "bitsandbytes_nf4"), ("ZImageTransformer2DModel", "bitsandbytes_nf4")]
    else:
        assert not quantised


def _commented_command(script: Path, tmp: Path) -> list[str]:
    """The script's commented-out second command (Omni-Base's image(s)-to-image training), as difftune's argv."""
    lines = script.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# accelerate launch"))
    uncommented = tmp / script.name
    uncommented.write_text("\n".join(line[2:] for line in lines[start:] if line.startswith("# ")) + "\n")
    (argv,) = read_reference_script(uncommented).commands
    return argv


@pytest.mark.slow
@pytest.mark.parametrize("script", ["lora/Z-Image-Omni-Base.sh", "full/Z-Image-Omni-Base.sh"])
def test_omni_base_image_to_image_command_runs(in_workspace, script, capsys, tmp_path):
    argv = _commented_command(SCRIPTS / script, tmp_path)
    assert flag_value(argv, "--extra_inputs") == "edit_image"
    before = _checkpoints(argv)
    log = _run(argv, capsys)
    assert "features: base, edit, omni" in log
    _check_checkpoint(argv, in_workspace, before)


def test_i2l_script_is_refused_in_one_line(in_workspace, capsys):
    (argv,) = read_reference_script(SCRIPTS / "full/ZImage-i2L-v2.sh").commands
    assert difftune([*argv, "--max_steps", "2", "--no_progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--template_model_id_or_path" in err[0] and "Diffusion Templates" in err[0], err
