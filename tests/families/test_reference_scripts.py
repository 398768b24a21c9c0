"""The reference's scripts of the prompt-to-image families (tests/reference_scripts/<family>/model_training/, each
family's entry in manifest.py) with only `accelerate launch examples/<family>/model_training/train.py` replaced by
`difftune train` and `--max_steps 2` appended, on tiny models laid out under ./models at the hub ids they name and tiny
data sets where they look (the entry's workspace writer, tests/support/<family>). Where an entry resolves its scripts
first (models recognised, features, split: `support.scripts.resolve_scripts`), only the first of each distinct
configuration trains. Each run must leave its checkpoint in the layout its user loads; scripts of a missing feature
are refused in one line naming it; an entry's variants (a commented-out command, a flag changed) run too.

The families are split over two modules so that the two workers of `--dist loadfile` share them: this one runs
`FAMILIES`, test_reference_scripts_b.py the others (its own `FAMILIES`, these tests imported)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from difftune.cli.main import main as difftune
from families.manifest import FAMILIES as ENTRIES, Run, covered
from support import read_reference_script
from support.scripts import at_small_size, flag_value, resolve_scripts, trains_end_to_end

FAMILIES = ("z_image", "ernie_image", "ace_step", "stable_diffusion", "stable_diffusion_xl", "anima")
COVERED_SCRIPTS = covered(ENTRIES[f] for f in FAMILIES)  # tests/test_reference_coverage.py (reference_scripts/)


def pytest_generate_tests(metafunc):
    """Each test over the families of the module that collects it (pytest ids: the family, then the script)."""
    families = [ENTRIES[f] for f in metafunc.module.FAMILIES if ENTRIES[f].scripts]
    slow = (pytest.mark.slow,)
    if "family" in metafunc.fixturenames:
        metafunc.parametrize("family", families, ids=[f.name for f in families])
    elif "script_run" in metafunc.fixturenames:
        metafunc.parametrize("script_run", [pytest.param((f, s), id=f"{f.name}-{s}", marks=slow if f.scripts.slow
                                                         else ()) for f in families for s in f.scripts.runs])
    elif "refused" in metafunc.fixturenames:
        metafunc.parametrize("refused", [pytest.param((f, s), id=f"{f.name}-{s}") for f in families
                                         for s in f.scripts.all if f.scripts.refusal(s)])
    elif "variant" in metafunc.fixturenames:
        metafunc.parametrize("variant", [pytest.param((f, v), id=f"{f.name}-{v.id}", marks=slow if v.slow else ())
                                         for f in families for v in f.scripts.variants])


@pytest.fixture(scope="module")
def workspaces(tmp_path_factory):
    """family -> its workspace, written when a test of the family first asks (once per module)."""
    built = {}

    def get(family) -> Path:
        if family.name not in built:
            for package in family.scripts.needs:
                pytest.importorskip(package)
            built[family.name] = family.scripts.workspace(tmp_path_factory.mktemp(f"{family.name}_scripts"))
        return built[family.name]
    return get


@pytest.fixture(scope="module")
def configurations(workspaces):
    """family -> its running scripts resolved in its workspace (once per module)."""
    resolved = {}

    def get(family):
        if family.name not in resolved:
            with pytest.MonkeyPatch.context() as patch:
                patch.chdir(workspaces(family))
                patch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "true")
                resolved[family.name] = resolve_scripts(family.scripts.root, family.scripts.runs)
        return resolved[family.name]
    return get


def _enter(workspace: Path, monkeypatch) -> Path:
    monkeypatch.chdir(workspace)
    monkeypatch.setenv("DIFFTUNE_SKIP_DOWNLOAD", "true")
    return workspace


def _run(argv, capsys, *extra) -> str:
    code = difftune([*at_small_size(argv), "--max_steps", "2", "--no_progress", *extra])
    out = capsys.readouterr()
    assert code == 0, f"`difftune {' '.join(argv)}` exited {code}: {out.err.strip()[-2000:]}"
    return out.out + out.err


def _checkpoints(argv) -> dict[Path, int]:
    return {p: p.stat().st_mtime_ns for p in Path(flag_value(argv, "--output_path")).glob("*.safetensors")}


def _written(argv, before: dict[Path, int]) -> dict:
    """The checkpoint this run wrote (a folder may hold another script's: lora/Z-Image-Turbo.sh's holds the LoRA the
    trajectory-imitation script starts from; the NPU copies write where the plain scripts do)."""
    files = sorted(p for p, t in _checkpoints(argv).items() if before.get(p) != t)
    assert files, f"no checkpoint in {flag_value(argv, '--output_path')}"
    return load_file(str(files[-1]))


def _check_checkpoint(family, saved: dict, argv, workspace: Path, script: str) -> None:
    entry = family.scripts
    if flag_value(argv, "--lora_base_model"):
        saved = entry.canonical(workspace, saved) if entry.canonical else saved
        # the entry's modules in its layout, at the script's rank, trained
        ends = (".lora_A.weight", ".lora_B.weight", *((".alpha",) if entry.lora_alpha else ()))
        stray = [k for k in saved if not (k.startswith(entry.lora_prefix) and k.endswith(ends))]
        assert not stray, stray[:5]
        modules = {k[len(entry.lora_prefix):].rpartition(".lora_")[0] for k in saved if ".lora_" in k}
        assert (modules == entry.lora_modules) if entry.lora_exact else (entry.lora_modules <= modules), \
            sorted(modules ^ entry.lora_modules)[:10]
        rank = int(flag_value(argv, "--lora_rank"))
        for module in entry.lora_modules:
            assert saved[f"{entry.lora_prefix}{module}.lora_A.weight"].shape[0] == rank, module
        assert any(v.abs().max() > 0 for k, v in saved.items() if ".lora_B." in k)
        return
    released = entry.full(workspace, argv, script)
    if isinstance(released, dict):  # the released file's keys, trained away from it
        assert saved.keys() == released.keys()
        assert any(not torch.equal(saved[k], released[k].to(saved[k].dtype)) for k in saved)
    else:
        missing = [k for k in released if k not in saved]
        assert not missing, missing


def test_the_snapshot_has_the_scripts(family):
    entry = family.scripts
    scripts = entry.all
    if isinstance(entry.snapshot, int):
        assert len(scripts) == entry.snapshot
    else:
        assert scripts == list(entry.snapshot)
    assert len(entry.runs) == (entry.running if entry.running is not None else len(scripts))
    for refusal in entry.refusals:
        assert sum(map(refusal.picks, scripts)) == refusal.count, refusal.flag
    assert all(read_reference_script(entry.root / s).commands for s in scripts if s not in entry.inference_only)
    assert not any(read_reference_script(entry.root / s).commands for s in entry.inference_only)


def test_reference_script_runs(script_run, workspaces, configurations, capsys, monkeypatch):
    family, script = script_run
    entry = family.scripts
    workspace = _enter(workspaces(family), monkeypatch)
    notes = [note for part, note in entry.notes.items() if part in script]
    if entry.once_per_configuration:
        resolved = configurations(family)
        if not trains_end_to_end(script, resolved):  # resolved as an earlier script of its configuration, which trained
            assert all(note in resolved[script].log for note in notes)
            return
    check = entry.run_checks(script, monkeypatch) if entry.run_checks else None
    commands = read_reference_script(entry.root / script).commands
    before = _checkpoints(commands[-1])
    for argv in commands:
        log = _run(argv, capsys)
    assert f"family: {family.name}" in log
    assert all(note in log for note in notes)
    saved = _written(commands[-1], before)
    _check_checkpoint(family, saved, commands[-1], workspace, script)
    if check:
        check(Run(script, commands[-1], log, saved, workspace))


def test_refused_in_one_line(refused, workspaces, capsys, monkeypatch):
    family, script = refused
    _enter(workspaces(family), monkeypatch)
    why = family.scripts.refusal(script)
    argv = read_reference_script(family.scripts.root / script).commands[0]
    assert difftune([*argv, "--max_steps", "2", "--no_progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and why.flag in err[0] and why.says in err[0], err


def test_variant_runs(variant, workspaces, capsys, monkeypatch, tmp_path):
    family, v = variant
    workspace = _enter(workspaces(family), monkeypatch)
    argv = v.command(family.scripts.root / v.script, tmp_path)
    if v.extra_inputs:
        assert flag_value(argv, "--extra_inputs") == v.extra_inputs
    before = _checkpoints(argv)
    log = _run(argv, capsys, *v.extra)
    if v.log:
        assert v.log in log
    saved = _written(argv, before)
    if v.check:
        v.check(saved, workspace)
    else:
        _check_checkpoint(family, saved, argv, workspace, v.script)
