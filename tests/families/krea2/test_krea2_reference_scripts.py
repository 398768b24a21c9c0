"""The reference's Krea-2 scripts (tests/reference_scripts/krea2/model_training/, all 4) with only
`accelerate launch examples/krea2/model_training/train.py` replaced by `difftune train` and `--max_steps 2`
appended, on tiny models at the hub ids they name (Krea's single files, Qwen3-VL-4B's folder with its tokenizer,
Qwen-Image's VAE) and tiny data sets where they look. Each leaves its checkpoint in the layout its user loads: the
LoRA scripts (`--align_to_opensource_format`) diffusers' names behind `transformer.`, at the script's rank; the full
scripts the DiT without the `pipe.dit.` prefix, trained away from the file it started from."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from difftune.cli.main import main as difftune
from difftune.families.krea2.components import convert_original_dit
from support import read_reference_script
from support.krea2 import KREA2_RAW_REPO, KREA2_TURBO_REPO, write_krea2_script_workspace
from support.scripts import at_small_size, flag_value, resolve_scripts, trains_end_to_end

SCRIPTS = Path(__file__).resolve().parents[2] / "reference_scripts" / "krea2" / "model_training"
ALL = sorted(str(p.relative_to(SCRIPTS)) for p in SCRIPTS.rglob("*.sh"))
COVERED_SCRIPTS = {f"krea2/model_training/{s}" for s in ALL}  # tests/test_reference_coverage.py


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return write_krea2_script_workspace(tmp_path_factory.mktemp("krea2_scripts"))


@pytest.fixture(scope="module")
def configurations(workspace):
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(workspace)
        patch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "true")
        return resolve_scripts(SCRIPTS, ALL)


@pytest.fixture()
def in_workspace(workspace, monkeypatch):
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "true")
    return workspace


def test_the_snapshot_has_all_4_scripts():
    assert ALL == ["full/Krea-2-Raw.sh", "full/Krea-2-Turbo.sh", "lora/Krea-2-Raw.sh", "lora/Krea-2-Turbo.sh"]
    assert all(read_reference_script(SCRIPTS / s).commands for s in ALL)


def _run(argv, capsys, *extra) -> str:
    code = difftune([*at_small_size(argv), "--max_steps", "2", "--no_progress", *extra])
    out = capsys.readouterr()
    assert code == 0, f"`difftune {' '.join(argv)}` exited {code}: {out.err.strip()[-2000:]}"
    return out.out + out.err


@pytest.mark.slow
@pytest.mark.parametrize("script", ALL)
def test_reference_script_runs(in_workspace, configurations, script, capsys):
    (argv,) = read_reference_script(SCRIPTS / script).commands
    if not trains_end_to_end(script, configurations):
        return  # resolved as an earlier script of its configuration did, which trained
    log = _run(argv, capsys)
    assert "family: krea2" in log
    out = Path(flag_value(argv, "--output_path"))
    saved = load_file(str(sorted(out.glob("*.safetensors"))[-1]))
    repo, name = (KREA2_RAW_REPO, "raw.safetensors") if "Raw" in script else (KREA2_TURBO_REPO, "turbo.safetensors")
    if script.startswith("lora/"):
        assert all(k.startswith("transformer.") and k.endswith((".lora_A.weight", ".lora_B.weight")) for k in saved)
        for module in ("transformer_blocks.0.attn.to_q", "transformer_blocks.1.ff.down", "img_in",
                       "text_fusion.projector", "time_mod_proj", "final_layer.linear"):
            assert saved[f"transformer.{module}.lora_A.weight"].shape[0] == int(flag_value(argv, "--lora_rank"))
        assert any(v.abs().max() > 0 for k, v in saved.items() if ".lora_B." in k)
    else:
        started = convert_original_dit(load_file(str(in_workspace / "models" / repo / name)))
        assert saved.keys() == started.keys()  # the whole DiT, diffusers' names, `pipe.dit.` removed
        assert any(not torch.equal(saved[k], started[k].to(saved[k].dtype)) for k in saved)


def test_full_script_in_the_original_names(in_workspace, capsys):
    """`--full_format original`: the checkpoint in raw.safetensors' own names (the reference's and ComfyUI's)."""
    (argv,) = read_reference_script(SCRIPTS / "full/Krea-2-Raw.sh").commands
    argv = [*argv[:argv.index("--output_path") + 1], "./models/train/Krea-2-Raw_full_original",
            *argv[argv.index("--output_path") + 2:]]
    _run(argv, capsys, "--full_format", "original", "--max_pixels", "1024")
    saved = load_file(str(sorted(Path("models/train/Krea-2-Raw_full_original").glob("*.safetensors"))[-1]))
    assert saved.keys() == load_file(str(in_workspace / "models" / KREA2_RAW_REPO / "raw.safetensors")).keys()
