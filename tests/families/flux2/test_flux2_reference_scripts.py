"""The reference's FLUX.2 scripts (tests/reference_scripts/flux2/model_training/) with only
`accelerate launch examples/flux2/model_training/train.py` replaced by `difftune train` and `--max_steps 2` appended,
on tiny models laid out under ./models at the hub ids they name and tiny data sets where they look
(`support.flux2.write_flux2_script_workspace`). Each must leave its checkpoint in the layout its user loads; the
Diffusion Templates scripts and DMD2 are refused in one line naming what is missing."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from difftune.cli.main import main as difftune
from support import read_reference_script
from support.flux2.scripts import write_flux2_script_workspace
from support.scripts import at_small_size, flag_value, resolve_scripts, trains_end_to_end

SCRIPTS = Path(__file__).resolve().parents[2] / "reference_scripts" / "flux2" / "model_training"
ALL = sorted(str(p.relative_to(SCRIPTS)) for p in SCRIPTS.rglob("*.sh"))
INFERENCE_ONLY = ["full/TreeAdapter-KleinBase4B.sh"]  # comments only: "supports inference only"
TEMPLATES = [s for s in ALL if "Template-" in s or "i2L" in s]
DMD2 = [s for s in ALL if "dmd2" in s]
RUNNING = [s for s in ALL if s not in TEMPLATES and s not in DMD2 and s not in INFERENCE_ONLY]
COVERED_SCRIPTS = {f"flux2/model_training/{s}" for s in ALL}  # tests/test_reference_coverage.py


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return write_flux2_script_workspace(tmp_path_factory.mktemp("flux2_scripts"))


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


def test_the_snapshot_has_its_scripts():
    assert len(ALL) == 27 and len(RUNNING) == 12 and len(TEMPLATES) == 13 and len(DMD2) == 1
    assert all(read_reference_script(SCRIPTS / s).commands for s in ALL if s not in INFERENCE_ONLY)
    assert not read_reference_script(SCRIPTS / INFERENCE_ONLY[0]).commands


def _run(argv, capsys) -> str:
    code = difftune([*at_small_size(argv), "--max_steps", "2", "--no_progress"])
    out = capsys.readouterr()
    assert code == 0, f"`difftune {' '.join(argv)}` exited {code}: {out.err.strip()[-2000:]}"
    return out.out + out.err


def _check_checkpoint(argv) -> dict:
    files = sorted(Path(flag_value(argv, "--output_path")).glob("*.safetensors"))
    assert files, f"no checkpoint in {flag_value(argv, '--output_path')}"
    saved = load_file(str(files[-1]))
    if flag_value(argv, "--lora_base_model"):
        # every module the script names, in diffusers' layout (transformer.<module>), at the script's rank
        rank = int(flag_value(argv, "--lora_rank"))
        for module in ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.add_k_proj",
                       "transformer_blocks.0.attn.to_out.0", "transformer_blocks.0.ff.linear_in",
                       "transformer_blocks.0.ff_context.linear_out", "single_transformer_blocks.0.attn.to_qkv_mlp_proj",
                       "single_transformer_blocks.19.attn.to_out"):
            key = f"transformer.{module}.lora_A.weight"
            assert key in saved and saved[key].shape[0] == rank, key
        assert all(k.startswith("transformer.") for k in saved)
        assert any(v.abs().max() > 0 for k, v in saved.items() if ".lora_B." in k)
    else:  # the DiT in diffusers' names, "pipe.dit." removed
        assert "x_embedder.weight" in saved and "single_transformer_blocks.0.attn.to_out.weight" in saved
    return saved


@pytest.mark.slow
@pytest.mark.parametrize("script", RUNNING)
def test_reference_script_runs(in_workspace, configurations, script, capsys):
    commands = read_reference_script(SCRIPTS / script).commands
    if not trains_end_to_end(script, configurations):
        return  # resolved as an earlier script of its configuration did, which trained
    for argv in commands:
        _run(argv, capsys)
    _check_checkpoint(commands[-1])


@pytest.mark.parametrize("script", TEMPLATES)
def test_template_scripts_are_refused_in_one_line(in_workspace, script, capsys):
    argv = read_reference_script(SCRIPTS / script).commands[0]
    assert difftune([*argv, "--max_steps", "2", "--no_progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--template_model_id_or_path" in err[0] and "Diffusion Templates" in err[0], err


def test_dmd2_script_is_refused_in_one_line(in_workspace, capsys):
    (argv,) = read_reference_script(SCRIPTS / DMD2[0]).commands
    assert difftune([*argv, "--max_steps", "2", "--no_progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--dmd2_fake_score_learning_rate" in err[0] and "DMD2 distillation" in err[0], err


def _commented_command(script: Path, tmp: Path) -> list[str]:
    """The script's commented-out edit command (Qwen-Image-Edit-2511's data, `--extra_inputs edit_image`)."""
    lines = script.read_text().splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("# accelerate launch"))
    uncommented = tmp / script.name
    uncommented.write_text("\n".join(line[2:] for line in lines[start:] if line.startswith("# ")) + "\n")
    (argv,) = read_reference_script(uncommented).commands
    return argv


@pytest.mark.slow
def test_klein_edit_command_runs(in_workspace, capsys, tmp_path):
    """lora/FLUX.2-klein-4B.sh's commented edit command: two edit images per row (a JSON list). Appended:
    `--edit_image_auto_resize false`, which keeps the tiny edit images at their size (the reference's resize to
    about 1024 x 1024 is the default; it makes this CPU run a minute longer)."""
    argv = _commented_command(SCRIPTS / "lora/FLUX.2-klein-4B.sh", tmp_path)
    assert flag_value(argv, "--extra_inputs") == "edit_image"
    log = _run([*argv, "--edit_image_auto_resize", "false"], capsys)
    assert "features: base, edit" in log
    _check_checkpoint(argv)
