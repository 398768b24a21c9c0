"""Split training against one-stage training on the same model, data and flags.

Three runs of the CLI path, one process each: `sft` (one stage), `sft:data_process` (stage 1) and
`sft:train` (stage 2, from that cache). Prints one JSON line; writes its table to docs/benchmarks.md.

    .venv/bin/python benchmarks/split_vs_unsplit.py            # the proportional model (~3 min here)
    .venv/bin/python benchmarks/split_vs_unsplit.py --quick    # smoke run on the tests' tiny model
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import common  # noqa: E402
from common import (base_parser, cache_bytes, data_wait_share, emit, machine, machine_line, prepare,  # noqa: E402
                    proportional, quick, ratio, resolve_doc, run_difftune, split_figures, table, train_flags,
                    update_doc, verdict, workdir_of)


def param_counts(repo: Path) -> dict:
    """Parameters per component, from the safetensors headers of the files the runs load."""
    counts = common.param_counts(repo, {"dit": "transformer/*.safetensors", "text_encoder": "text_encoder/*.safetensors",
                                        "vae": "vae/*.safetensors"})
    counts["text_encoder_over_dit"] = counts["text_encoder"] / counts["dit"]
    counts["vae_over_dit"] = counts["vae"] / counts["dit"]
    return counts


def main(argv=None) -> dict:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=None)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--repeat", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None, help="step intervals left out of the step time")
    args = p.parse_args(argv)
    cfg = quick() if args.quick else proportional()
    n = args.images or (2 if args.quick else 8)
    epochs = args.epochs or (1 if args.quick else 2)
    repeat = args.repeat or (3 if args.quick else 4)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    isolated = not args.quick
    info = machine(args.threads)
    with workdir_of(args) as wd:
        ws = prepare(wd, cfg, n)
        params = param_counts(ws.repo)
        one = run_difftune(train_flags(ws, "sft", wd / "one", epochs=epochs, repeat=repeat), isolated, args.threads)
        s1 = run_difftune(train_flags(ws, "sft:data_process", wd / "cache", components=("text_encoder", "vae")),
                          isolated, args.threads)
        s2 = run_difftune(train_flags(ws, "sft:train", wd / "two", dataset=wd / "cache", epochs=epochs,
                                      repeat=repeat, components=("transformer",)), isolated, args.threads)
        cb = cache_bytes(wd / "cache")

    # the reference's --num_epochs 5 --dataset_repeat 50
    figures = split_figures(one, s1, s2, warmup, ref_steps=n * 5 * 50, tag="5x50")
    result = {
        "benchmark": "split_vs_unsplit", "config": cfg.name, "resolution": cfg.resolution, "images": n,
        "epochs": epochs, "repeat": repeat, "steps": one["steps"], "warmup_steps": warmup,
        "isolated_processes": isolated, "params": params, **figures,
        "process_wall_ratio": ratio(s1["wall_seconds"] + s2["wall_seconds"], one["wall_seconds"]),
        "cache_bytes_per_sample": cb["disk_bytes"] / max(1, cb["samples"]),
        "cached_tensor_bytes_per_sample": cb["tensor_bytes"] / max(1, cb["samples"]),
        "cache_bytes_ratio": ratio(cb["disk_bytes"], cb["tensor_bytes"]),
        "data_wait_share_stage2": data_wait_share(s2, warmup),
        "data_wait_share_one_stage": data_wait_share(one, warmup),
        "machine": info,
    }
    result["targets"] = {
        "peak_rss_ratio": {"target": "<= 0.75", "value": result["peak_rss_ratio"],
                           "met": result["peak_rss_ratio"] <= 0.75},
        "total_time_ratio": {"target": "<= 0.8", "value": result["total_time_ratio"],
                             "met": result["total_time_ratio"] <= 0.8},
        "cache_bytes_ratio": {"target": "<= 1.02", "value": result["cache_bytes_ratio"],
                              "met": result["cache_bytes_ratio"] <= 1.02},
        "data_wait_share_stage2": {"target": "<= 0.02", "value": result["data_wait_share_stage2"],
                                   "met": result["data_wait_share_stage2"] <= 0.02},
    }
    update_doc(resolve_doc(args), "split_vs_unsplit", render(result))
    emit(result)
    return result


def render(r: dict) -> str:
    p = r["params"]
    rows = [
        ["step time (s, median after warm-up)", r["step_time_one_stage_s"], r["step_time_stage2_s"],
         r["step_time_ratio"], "—", "—"],
        ["peak RSS (MiB, VmHWM)", r["peak_rss_one_stage_mib"], r["peak_rss_stage2_mib"], r["peak_rss_ratio"],
         "≤ 0.75", verdict(r["peak_rss_ratio"], 0.75)],
        [f"peak RSS above the {r['baseline_rss_mib']:.0f} MiB interpreter+libraries baseline",
         r["peak_rss_one_stage_mib"] - r["baseline_rss_mib"],
         r["peak_rss_stage2_mib"] - r["baseline_rss_mib"], r["peak_rss_above_baseline_ratio"], "(≤ 0.75)",
         verdict(r["peak_rss_above_baseline_ratio"], 0.75)],
        [f"total time (s), {r['images']} images x {r['epochs']} epochs x repeat {r['repeat']} "
         f"= {r['steps']} steps; split = stage 1 + stage 2", r["total_time_one_stage_s"], r["total_time_split_s"],
         r["total_time_ratio"], "≤ 0.8", verdict(r["total_time_ratio"], 0.8)],
        ["same, whole processes (interpreter start and imports included)", "", "", r["process_wall_ratio"], "—",
         "—"],
        [f"projected to --num_epochs 5 --dataset_repeat 50 ({r['images'] * 250} steps)", "", "",
         r["projected_total_time_ratio_5x50"], "(≤ 0.8)", verdict(r["projected_total_time_ratio_5x50"], 0.8)],
        ["cache bytes on disk ÷ bytes of the cached tensors", "", f"{r['cache_bytes_per_sample']:.0f} B/sample",
         r["cache_bytes_ratio"], "≤ 1.02", verdict(r["cache_bytes_ratio"], 1.02)],
        ["share of a step waiting for data", r["data_wait_share_one_stage"], r["data_wait_share_stage2"], "",
         "≤ 0.02 (stage 2)", verdict(r["data_wait_share_stage2"], 0.02)],
    ]
    head = (f"Config `{r['config']}` at {r['resolution']}x{r['resolution']}: DiT {p['dit'] / 1e6:.1f}M, text encoder "
            f"{p['text_encoder'] / 1e6:.1f}M ({p['text_encoder_over_dit']:.2f}x the DiT), VAE {p['vae'] / 1e6:.2f}M "
            f"parameters; LoRA rank 32 on the 12 reference target modules; fp32; stage 1 took "
            f"{r['stage1_seconds']:.1f} s (model loading included).")
    return "\n\n".join([head, table(["metric", "one stage", "split (stage 2)", "split ÷ one stage", "target",
                                     "verdict"], rows), machine_line(r["machine"])])


if __name__ == "__main__":
    main()
