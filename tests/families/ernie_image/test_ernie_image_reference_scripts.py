"""The reference's ERNIE-Image scripts (tests/reference_scripts/ernie_image/model_training/, both) with only
`accelerate launch examples/ernie_image/model_training/train.py` replaced by `difftune train` and `--max_steps 2`
appended, on tiny models laid out under ./models at the hub id they name and a tiny data set where they look
(`support.write_ernie_image_script_workspace`). Each leaves its checkpoint in the layout its user loads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from difftune.cli.main import main as difftune
from support import read_reference_script
from support.ernie_image import REPO, write_ernie_image_script_workspace
from support.scripts import at_small_size, flag_value

SCRIPTS = Path(__file__).resolve().parents[2] / "reference_scripts" / "ernie_image" / "model_training"
ALL = sorted(str(p.relative_to(SCRIPTS)) for p in SCRIPTS.rglob("*.sh"))
COVERED_SCRIPTS = {f"ernie_image/model_training/{s}" for s in ALL}  # tests/test_reference_coverage.py


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return write_ernie_image_script_workspace(tmp_path_factory.mktemp("ernie_image_scripts"))


@pytest.fixture()
def in_workspace(workspace, monkeypatch):
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "true")
    return workspace


def test_the_snapshot_has_both_scripts():
    assert ALL == ["full/ERNIE-Image.sh", "lora/ERNIE-Image.sh"]


def _released_dit(workspace) -> dict:
    out = {}
    for f in sorted((workspace / "models" / REPO / "transformer").glob("*.safetensors")):
        out.update(load_file(str(f)))
    return out


@pytest.mark.parametrize("script", ALL)
def test_reference_script_runs(in_workspace, script, capsys):
    (argv,) = read_reference_script(SCRIPTS / script).commands
    code = difftune([*at_small_size(argv), "--max_steps", "2", "--no_progress"])
    out = capsys.readouterr()
    assert code == 0, f"`difftune {' '.join(argv)}` exited {code}: {out.err.strip()[-2000:]}"
    assert "family: ernie_image" in out.out + out.err
    files = sorted(Path(flag_value(argv, "--output_path")).glob("*.safetensors"))
    assert files, f"no checkpoint in {flag_value(argv, '--output_path')}"
    saved = load_file(str(files[-1]))
    if flag_value(argv, "--lora_base_model"):
        # the script's targets on every block, diffusers' layout (what ErnieImagePipeline.load_lora_weights reads)
        rank = int(flag_value(argv, "--lora_rank"))
        modules = {k.rpartition(".lora_")[0] for k in saved}
        assert modules == {f"transformer.layers.{i}.self_attention.{t}" for i in range(2)
                           for t in ("to_q", "to_k", "to_v", "to_out.0")}
        assert all(saved[f"{m}.lora_A.weight"].shape[0] == rank for m in modules)
        assert any(v.abs().max() > 0 for k, v in saved.items() if ".lora_B." in k)
    else:
        # the whole DiT, `pipe.dit.` removed: diffusers' names, as the released transformer/ shards, and trained
        released = _released_dit(in_workspace)
        assert saved.keys() == released.keys()
        assert any(not torch.equal(saved[k].float(), released[k].float()) for k in saved)
