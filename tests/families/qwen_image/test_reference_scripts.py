"""The reference's own Qwen-Image-family scripts are acceptance tests.

Every script in tests/reference_scripts/qwen_image/model_training/ (DiffSynth-Studio fed7b18, see SOURCE.md)
runs with only `accelerate launch .../train.py` replaced by `difftune train`, on tiny models laid out as the
scripts name them, plus `--max_steps 2`. Each command must leave what it is for: a checkpoint
(`*.safetensors` in its --output_path) or, for `--task *:data_process`, a complete stage-1 cache.
"""

from pathlib import Path

import pytest

from difftune.cli.main import main
from support import read_reference_script, write_qwen_image_script_workspace
from support.lora_presets import check_merge, record_merges
from support.scripts import flag_value

# see tests/conftest.py: each picture encoded once; narrow conv3d layers as conv2d per time tap
pytestmark = pytest.mark.usefixtures("reuse_vae_encodes", "narrow_conv3d_by_frames")
SCRIPTS = Path(__file__).resolve().parents[2] / "reference_scripts" / "qwen_image" / "model_training"
QWEN_SCRIPTS = sorted(str(p.relative_to(SCRIPTS)) for p in SCRIPTS.rglob("*.sh"))

# What a script needs besides --max_steps 2, and why.
EXTRA = {
    # Its second command presets the first run's epoch-4.safetensors: run the first for its 5 epochs (of 2 rows).
    "special/differential_training/Qwen-Image-LoRA.sh": ["--dataset_repeat", "1"],
}


def test_the_snapshot_holds_all_39_scripts():
    assert len(QWEN_SCRIPTS) == 39
    assert all(read_reference_script(SCRIPTS / s).commands for s in QWEN_SCRIPTS)


@pytest.fixture(scope="module")
def workspace(tmp_path_factory):
    return write_qwen_image_script_workspace(tmp_path_factory.mktemp("qwen_scripts"))


@pytest.mark.slow
@pytest.mark.parametrize("script", QWEN_SCRIPTS)
def test_reference_script_runs(script, workspace, monkeypatch, capsys):
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "true")
    parsed = read_reference_script(SCRIPTS / script)
    merges = record_merges(monkeypatch)
    for argv in parsed.commands:
        out = Path(flag_value(argv, "--output_path"))
        extra = EXTRA.get(script, ["--max_steps", "2"])
        code = main([*argv, *extra, "--no_progress"])
        err = capsys.readouterr().err
        assert code == 0, f"{script}: `difftune {' '.join(argv[:1])} ...` exited {code}: {err.strip()[-2000:]}"
        if (flag_value(argv, "--task") or "").endswith("data_process"):
            assert (out / "complete.json").exists() or any(out.rglob("complete.json")), f"{script}: no cache"
        else:
            assert list(out.glob("*.safetensors")), f"{script}: no checkpoint in {out}"
        if flag_value(argv, "--preset_lora_path"):  # the differential script: the first run's LoRA, merged
            assert check_merge(merges, flag_value(argv, "--preset_lora_path")) > 0
    assert merges or not any(flag_value(a, "--preset_lora_path") for a in parsed.commands)
