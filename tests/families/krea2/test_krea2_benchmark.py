"""The Krea-2 split benchmark's smoke run (--quick, the tests' tiny models): three CLI runs and its JSON line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.mark.slow
def test_krea2_split_vs_unsplit_quick(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "krea2_split_vs_unsplit.py"), "--quick",
                           "--no-doc", "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=600,
                          cwd=str(ROOT), env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert r["benchmark"] == "krea2_split_vs_unsplit" and r["steps"] == 4
    assert r["params"]["transformer"] > 0 and r["qwen3_vl_encode_s"] > 0 and r["step_time_ratio"] > 0
