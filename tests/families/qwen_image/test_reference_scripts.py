"""The reference's own Qwen-Image-family scripts are acceptance tests.

Every script in tests/reference_scripts/qwen_image/model_training/ (DiffSynth-Studio fed7b18, see SOURCE.md) is
read with only `accelerate launch .../train.py` replaced by `difftune train`, on tiny models laid out as the scripts
name them: its models recognised, its features resolved and its split computed (`support.scripts.resolve_scripts`).
The first script of each distinct configuration (pipeline, features, task, what trains, code-path flags) runs, plus
`--max_steps 2`: each command must leave what it is for, a checkpoint (`*.safetensors` in its --output_path) or, for
`--task *:data_process`, a complete stage-1 cache.
"""

from pathlib import Path

import pytest

from difftune.cli.main import main
from support import read_reference_script, write_qwen_image_script_workspace
from support.lora_presets import check_merge, record_merges
from support.scripts import at_small_size, flag_value, resolve_scripts, trains_end_to_end

SCRIPTS = Path(__file__).resolve().parents[2] / "reference_scripts" / "qwen_image" / "model_training"
QWEN_SCRIPTS = sorted(str(p.relative_to(SCRIPTS)) for p in SCRIPTS.rglob("*.sh"))
COVERED_SCRIPTS = {f"qwen_image/model_training/{s}" for s in QWEN_SCRIPTS}  # tests/test_reference_coverage.py

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


@pytest.fixture(scope="module")
def configurations(workspace):
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(workspace)
        patch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "true")
        return resolve_scripts(SCRIPTS, QWEN_SCRIPTS)


@pytest.mark.slow
@pytest.mark.parametrize("script", QWEN_SCRIPTS)
def test_reference_script_runs(script, workspace, configurations, monkeypatch, capsys):
    if not trains_end_to_end(script, configurations):
        return  # resolved as an earlier script of its configuration did, which trained
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "true")
    parsed = read_reference_script(SCRIPTS / script)
    merges = record_merges(monkeypatch)
    for argv in parsed.commands:
        out = Path(flag_value(argv, "--output_path"))
        extra = EXTRA.get(script, ["--max_steps", "2"])
        # edit images at their own small size, not resized to a megapixel (the resize: test_qwen_image_edit_plus.py)
        small = ["--edit_image_auto_resize", "false"] if "edit_image" in (flag_value(argv, "--extra_inputs") or "") \
            else []
        code = main([*at_small_size(argv), *small, *extra, "--no_progress"])
        err = capsys.readouterr().err
        assert code == 0, f"{script}: `difftune {' '.join(argv[:1])} ...` exited {code}: {err.strip()[-2000:]}"
        if (flag_value(argv, "--task") or "").endswith("data_process"):
            assert (out / "complete.json").exists() or any(out.rglob("complete.json")), f"{script}: no cache"
        else:
            assert list(out.glob("*.safetensors")), f"{script}: no checkpoint in {out}"
        if flag_value(argv, "--preset_lora_path"):  # the differential script: the first run's LoRA, merged
            assert check_merge(merges, flag_value(argv, "--preset_lora_path")) > 0
    assert merges or not any(flag_value(a, "--preset_lora_path") for a in parsed.commands)
