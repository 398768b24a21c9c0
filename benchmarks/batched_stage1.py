"""Stage-1 throughput: samples of equal size encoded in batches against one at a time.

Two `sft:data_process` runs of the CLI path on the same equal-size images, `--data_process_batch_size B`
against `--data_process_batch_size 1`, each in a fresh process. Throughput counts the samples written
after the first batch, up to the writer's close (model loading and warm-up left out).

    .venv/bin/python benchmarks/batched_stage1.py            # the proportional model (~1.5 min here)
    .venv/bin/python benchmarks/batched_stage1.py --quick    # smoke run on the tests' tiny model
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (base_parser, emit, machine, machine_line, prepare, proportional, quick, ratio,  # noqa: E402
                    resolve_doc, run_difftune, stage1_rate, table, train_flags, update_doc, verdict, workdir_of)


def main(argv=None) -> dict:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=None)
    p.add_argument("--batch_size", type=int, default=None, help="default 8 (2 with --quick)")
    p.add_argument("--workers", type=int, default=0, help="--dataset_num_workers of both runs")
    args = p.parse_args(argv)
    cfg = quick() if args.quick else proportional()
    n = args.images or (6 if args.quick else 40)
    args.batch_size = args.batch_size or (2 if args.quick else 8)
    isolated = not args.quick
    info = machine(args.threads)
    runs = {}
    with workdir_of(args) as wd:
        ws = prepare(wd, cfg, n)
        for b in (1, args.batch_size):
            runs[b] = run_difftune(train_flags(ws, "sft:data_process", wd / f"cache-b{b}",
                                               components=("text_encoder", "vae"),
                                               extra=["--data_process_batch_size", b, "--dataset_num_workers",
                                                      args.workers]), isolated, args.threads)
    one, batched = stage1_rate(runs[1], 1), stage1_rate(runs[args.batch_size], args.batch_size)
    result = {
        "benchmark": "batched_stage1", "config": cfg.name, "resolution": cfg.resolution, "images": n,
        "batch_size": args.batch_size, "workers": args.workers, "isolated_processes": isolated,
        "samples_per_s_one_at_a_time": one, "samples_per_s_batched": batched,
        "batched_speedup": ratio(batched, one),
        "run_seconds_one_at_a_time": runs[1]["run_seconds"], "run_seconds_batched": runs[args.batch_size]["run_seconds"],
        "peak_rss_one_at_a_time_mib": runs[1]["vmhwm_kb"] / 1024,
        "peak_rss_batched_mib": runs[args.batch_size]["vmhwm_kb"] / 1024,
        "machine": info,
    }
    result["targets"] = {"batched_speedup": {"target": ">= 1.5", "value": result["batched_speedup"],
                                             "met": result["batched_speedup"] >= 1.5}}
    update_doc(resolve_doc(args), "batched_stage1", render(result))
    emit(result)
    return result


def render(r: dict) -> str:
    rows = [["samples/s after the first batch", r["samples_per_s_one_at_a_time"], r["samples_per_s_batched"],
             r["batched_speedup"], "≥ 1.5", verdict(r["batched_speedup"], 1.5, at_most=False)],
            ["whole run (s, model loading included)", r["run_seconds_one_at_a_time"], r["run_seconds_batched"],
             ratio(r["run_seconds_one_at_a_time"], r["run_seconds_batched"]), "—", "—"],
            ["peak RSS (MiB, VmHWM)", r["peak_rss_one_at_a_time_mib"], r["peak_rss_batched_mib"],
             ratio(r["peak_rss_batched_mib"], r["peak_rss_one_at_a_time_mib"]), "—", "—"]]
    head = (f"Config `{r['config']}`: {r['images']} images of {r['resolution']}x{r['resolution']}, "
            f"`--data_process_batch_size {r['batch_size']}` against 1, `--dataset_num_workers {r['workers']}`.")
    return "\n\n".join([head, table(["metric", "one at a time", f"batches of {r['batch_size']}",
                                     "batched ÷ one at a time", "target", "verdict"], rows),
                        machine_line(r["machine"])])


if __name__ == "__main__":
    main()
