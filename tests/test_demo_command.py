"""`difftune demo` (the README's first command) writes every file it promises and learns the concept."""

import json

from PIL import Image


def test_demo_short_run(tmp_path):
    from difftune.demo import main

    assert main(["--output", str(tmp_path / "demo"), "--steps", "40", "--sample_steps", "4"]) == 0
    out = tmp_path / "demo"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 40
    for key in ("stage1_seconds", "stage2_seconds", "stage1_peak_rss_mb", "stage2_peak_rss_mb"):
        assert summary[key] > 0
    assert summary["latent_distance_after"] < summary["latent_distance_before"]  # closer to the concept
    assert (out / "lora" / "epoch-0.safetensors").exists() and (out / "cache" / "manifest.json").exists()
    assert Image.open(out / "samples.png").size == (4 * 64, 2 * 64)  # before row, after row
    assert Image.open(out / "loss.png").size[0] > 0
