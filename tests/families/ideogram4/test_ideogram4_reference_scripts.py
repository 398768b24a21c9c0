"""The reference's Ideogram-4 scripts (tests/reference_scripts/ideogram4/model_training/, all 4) with only
`accelerate launch examples/ideogram4/model_training/train.py` replaced by `difftune train` and `--max_steps 2`
appended, on tiny models laid out under ./models at the hub ids they name and tiny data sets where they look
(`support.write_ideogram4_script_workspace`). Each leaves its checkpoint in the default layout: the LoRA in diffusers'
(the only one diffusers reads with the final layer's modulation the scripts' `adaln_modulation` takes; difftune's
`pipe.load_lora` in the `validate_lora` lines reads it too, the reference's own loader reads `--lora_format
comfyui`: test_ideogram4_lora.py), the fully trained DiT in diffusers' names (its transformer/ folder's, which
difftune and diffusers load; `--full_format original` for Ideogram's). The fp8 and nf4 scripts load ideogram-ai's
pre-quantised releases (models/prequant.py) and train the LoRA on top."""

from __future__ import annotations

from pathlib import Path

import pytest
from safetensors.torch import load_file

from difftune.cli.main import main as difftune
from support import read_reference_script
from support.ideogram4 import write_ideogram4_script_workspace
from support.scripts import at_small_size, flag_value

SCRIPTS = Path(__file__).resolve().parents[2] / "reference_scripts" / "ideogram4" / "model_training"
ALL = sorted(str(p.relative_to(SCRIPTS)) for p in SCRIPTS.rglob("*.sh"))
COVERED_SCRIPTS = {f"ideogram4/model_training/{s}" for s in ALL}  # tests/test_reference_coverage.py
QUANTISED = {"lora/Ideogram-4-fp8.sh": "fp8", "lora/Ideogram-4-nf4.sh": "nf4"}


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    pytest.importorskip("bitsandbytes")  # writes the nf4 release
    return write_ideogram4_script_workspace(tmp_path_factory.mktemp("ideogram4_scripts"))


@pytest.fixture()
def in_workspace(workspace, monkeypatch):
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "true")
    return workspace


def test_the_snapshot_has_all_4_scripts():
    assert ALL == ["full/Ideogram-4-bf16-repackage.sh", "lora/Ideogram-4-bf16-repackage.sh",
                   "lora/Ideogram-4-fp8.sh", "lora/Ideogram-4-nf4.sh"]


@pytest.mark.parametrize("script", ALL)
def test_reference_script_runs(in_workspace, script, capsys):
    (argv,) = read_reference_script(SCRIPTS / script).commands
    code = difftune([*at_small_size(argv), "--max_steps", "2", "--no_progress"])
    out = capsys.readouterr()
    log = out.out + out.err
    assert code == 0, f"`difftune {' '.join(argv)}` exited {code}: {out.err.strip()[-2000:]}"
    assert "family: ideogram4" in log
    files = sorted(Path(flag_value(argv, "--output_path")).glob("*.safetensors"))
    assert files, f"no checkpoint in {flag_value(argv, '--output_path')}"
    saved = load_file(str(files[-1]))
    if flag_value(argv, "--lora_base_model"):
        rank = int(flag_value(argv, "--lora_rank"))
        modules = {k.rpartition(".lora_")[0] for k in saved if ".lora_" in k}
        want = {f"transformer.layers.{i}.{m}" for i in range(2) for m in
                ("attention.to_q", "attention.to_k", "attention.to_v", "attention.to_out.0", "feed_forward.w1",
                 "feed_forward.w2", "feed_forward.w3", "adaln_modulation")} | {"transformer.final_layer.adaln_modulation"}
        assert modules == want
        assert saved["transformer.layers.0.attention.to_q.lora_A.weight"].shape[0] == rank
        assert saved["transformer.final_layer.adaln_modulation.lora_A.weight"].shape[0] == rank
        assert any(v.abs().max() > 0 for k, v in saved.items() if ".lora_B." in k)
    else:
        assert "layers.0.attention.to_q.weight" in saved and "input_proj.weight" in saved  # `pipe.dit.` removed
    if script in QUANTISED:
        how = QUANTISED[script]
        # the DiT (its fused qkv split while packed) and the text encoder kept as the release stores them
        for slot, folder in (("dit", "transformer"), ("text_encoder", "text_encoder")):
            line = next((ln for ln in log.splitlines() if ln.startswith(f"{slot}: ")), "")
            assert f"ideogram-4-{how}/{folder}/" in line and line.endswith(f"kept as stored ({how})"), log[-3000:]
