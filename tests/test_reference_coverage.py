"""Every script in the snapshot of the reference (tests/reference_scripts/, SOURCE.md) is in a test: each module that
runs or refuses scripts lists the ones it covers in `COVERED_SCRIPTS` (paths under tests/reference_scripts/), and a
snapshotted script no module lists fails here, naming it."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
SNAPSHOT = TESTS / "reference_scripts"


def _covering_modules() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py")
                  if "\nCOVERED_SCRIPTS = " in p.read_text() and p != Path(__file__).resolve())


def _covered() -> dict[str, list[str]]:
    """script -> the test modules that list it (imported as pytest imports them, so their lists are computed)."""
    import importlib

    out: dict[str, list[str]] = {}
    for path in _covering_modules():
        name = ".".join(path.relative_to(TESTS).with_suffix("").parts)
        module = importlib.import_module(name)
        for script in module.COVERED_SCRIPTS:
            out.setdefault(script, []).append(name)
    return out


def test_every_snapshotted_script_is_covered():
    scripts = sorted(p.relative_to(SNAPSHOT).as_posix() for p in SNAPSHOT.rglob("*.sh"))
    assert len(scripts) >= 166
    covered = _covered()
    missing = [s for s in scripts if s not in covered]
    assert not missing, f"{len(missing)} snapshotted script(s) in no test's COVERED_SCRIPTS: {missing}"
    stale = sorted(set(covered) - set(scripts))
    assert not stale, f"COVERED_SCRIPTS names scripts the snapshot does not hold: {stale}"


def test_a_module_covers_only_scripts_it_reads():
    """A module claims a script only if its text reads that family's snapshot folder (no claim by a stray list)."""
    for path in _covering_modules():
        tree = ast.parse(path.read_text())
        claimed = [n for n in ast.walk(tree) if isinstance(n, ast.Assign)
                   and any(getattr(t, "id", "") == "COVERED_SCRIPTS" for t in n.targets)]
        assert len(claimed) == 1, path
        assert "reference_scripts" in path.read_text(), path
