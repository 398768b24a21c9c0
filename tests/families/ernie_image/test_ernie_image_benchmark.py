"""benchmarks/ernie_image_split_vs_unsplit.py runs (its --quick smoke run on the tests' tiny model) and reports
finite ratios and the three components' sizes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def test_ernie_image_split_vs_unsplit_quick(tmp_path):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "ernie_image_split_vs_unsplit.py"), "--quick",
                           "--no-doc", "--workdir", str(tmp_path)], capture_output=True, text=True, timeout=300,
                          cwd=str(ROOT), env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    r = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
    assert r["benchmark"] == "ernie_image_split_vs_unsplit" and r["steps"] == 4
    for key in ("total_time_ratio", "projected_total_time_ratio_5x50", "step_time_ratio", "peak_rss_ratio",
                "text_share_of_one_stage_step", "vae_share_of_one_stage_step"):
        assert isinstance(r[key], float) and math.isfinite(r[key]) and r[key] > 0, key
    assert set(r["params"]) == {"transformer", "text_encoder", "vae"} and r["params"]["transformer"] > 0
