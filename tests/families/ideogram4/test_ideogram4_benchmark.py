"""The split benchmark's smoke run (benchmarks/ideogram4_split_vs_unsplit.py --quick) on the tests' tiny model."""

from __future__ import annotations

from test_benchmarks import assert_ratios, run_quick


def test_ideogram4_split_vs_unsplit_quick(tmp_path):
    r = run_quick("ideogram4_split_vs_unsplit.py", tmp_path, timeout=300)
    assert r["benchmark"] == "ideogram4_split_vs_unsplit" and r["steps"] == 4
    assert_ratios(r, ["total_time_ratio", "projected_total_time_ratio_5x100", "step_time_ratio", "peak_rss_ratio",
                      "text_share_of_one_stage_step", "vae_share_of_one_stage_step"])
    assert set(r["params"]) == {"transformer", "text_encoder", "vae"} and r["params"]["transformer"] > 0
    # stage 2 runs the DiT alone: Qwen3-VL's 36 layers and the AE are left out of its steps
    assert r["step_time_stage2_s"] < r["step_time_one_stage_s"]
