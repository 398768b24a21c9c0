"""The reference's scripts of the other prompt-to-image families: test_reference_scripts.py's tests (which say what
each run must leave) over this module's `FAMILIES`, so the two workers of `--dist loadfile` share the families."""

from __future__ import annotations

from families.manifest import FAMILIES as ENTRIES, covered
from families.test_reference_scripts import *  # noqa: F401,F403  the tests, fixtures and pytest_generate_tests

FAMILIES = ("flux2", "krea2", "ideogram4", "ltx2")
COVERED_SCRIPTS = covered(ENTRIES[f] for f in FAMILIES)  # tests/test_reference_coverage.py (reference_scripts/)
