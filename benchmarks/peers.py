"""difftune against DiffSynth-Studio's own training, side by side on the same model, data and flags.

Six runs, one fresh process each, interleaved so both frameworks see the same machine load:
one stage (`sft`), stage 1 (`sft:data_process`) and stage 2 (`sft:train`, from that stage's own cache),
for difftune (the CLI path) and for DiffSynth (`benchmarks/peer_diffsynth.py`, run in DiffSynth's own
venv: its PyPI package pins versions that differ from difftune's). Both load the same weight files and
read the same images and metadata.csv. Reported per framework: steps/s (median step time after
warm-up), peak RSS (VmHWM), stage-1 cache bytes on disk and stage-1 time; ratios are difftune ÷ DiffSynth.

    .venv/bin/python benchmarks/peers.py                   # the proportional model
    .venv/bin/python benchmarks/peers.py --quick --no-doc  # smoke run on the tests' tiny model

DiffSynth's venv (default /tmp/dsvenv, or --ds-python / $DIFFTUNE_BENCH_DS_PYTHON) is made, from the clone's root, with:

    python3 -m venv /tmp/dsvenv && /tmp/dsvenv/bin/pip install diffsynth==2.1.12 "diffusers>=0.40" -c constraints.txt

(PyPI only: constraints.txt pins torch as difftune's own install does; diffusers for difftune's families, which the
children import from src/, and for diffusers' script.)

Without it the script says so and skips (exit status 0, a JSON line with `skipped`).
"""

from __future__ import annotations

import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (PROMPTS, base_parser, cache_bytes, child_command, emit, fresh, machine, machine_line,  # noqa: E402
                    prepare, proportional, quick, ratio, resolve_doc, run_child, run_difftune, stage1_rate,
                    step_intervals, step_time, table, train_flags, update_doc, verdict, workdir_of)

DS_PYTHON = os.environ.get("DIFFTUNE_BENCH_DS_PYTHON", "/tmp/dsvenv/bin/python")
DIFFUSERS_SCRIPT = os.environ.get("DIFFTUNE_BENCH_DIFFUSERS_SCRIPT")
DIFFUSERS_WHY = ("diffusers' train_dreambooth_lora_qwen_image.py ships in neither the diffusers wheel nor its "
                 "sdist (only in the GitHub repository, examples/dreambooth/); pass --diffusers-script PATH "
                 "(or set DIFFTUNE_BENCH_DIFFUSERS_SCRIPT) to a copy of it to measure it")
CONSTRAINTS = Path(__file__).resolve().parents[1] / "constraints.txt"
HOW_TO = ("DiffSynth-Studio's venv is missing ({py}). Create it (a separate venv: diffsynth pins other "
          "versions than difftune), then run this again:\n"
          f"  python3 -m venv /tmp/dsvenv && /tmp/dsvenv/bin/pip install diffsynth==2.1.12 \"diffusers>=0.40\" "
          f"-c {CONSTRAINTS}")
MIB = 1024.0


def disk_bytes(folder: Path) -> int:
    return sum(p.stat().st_size for p in Path(folder).rglob("*") if p.is_file())


def ds_cache_files(folder: Path) -> list[Path]:
    return sorted(Path(folder).rglob("*.pth"))


def template_drop(repo: Path) -> int:
    """Template tokens difftune drops with the benchmark's tokenizer (DiffSynth hard-codes 34)."""
    from transformers import AutoTokenizer

    from difftune.families.qwen_image.units import PROMPT_TEMPLATE, template_drop_count

    return template_drop_count(AutoTokenizer.from_pretrained(str(repo / "tokenizer")), PROMPT_TEMPLATE)


def run_diffsynth(ds_python: str, payload: dict, threads: int) -> dict:
    return run_child(child_command(ds_python, Path(__file__).with_name("peer_diffsynth.py"), payload), threads)


def main(argv=None) -> dict:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--ds-python", default=DS_PYTHON, help="python of DiffSynth-Studio's venv")
    p.add_argument("--diffusers-script", default=DIFFUSERS_SCRIPT,
                   help="diffusers' examples/dreambooth/train_dreambooth_lora_qwen_image.py (from its repository)")
    p.add_argument("--images", type=int, default=None)
    p.add_argument("--epochs", type=int, default=None)
    p.add_argument("--repeat", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None, help="step intervals left out of the step time")
    p.add_argument("--rounds", type=int, default=None,
                   help="alternating difftune/DiffSynth stage-2 runs (step time: median of all their steps)")
    p.add_argument("--stage1_batch", type=int, default=None,
                   help="difftune's --data_process_batch_size (default: half the images, so the rate after "
                        "the first batch is measurable; DiffSynth encodes one sample at a time)")
    args = p.parse_args(argv)
    if not Path(args.ds_python).is_file():
        msg = HOW_TO.format(py=args.ds_python)
        print(msg, file=sys.stderr)
        result = {"benchmark": "peers", "skipped": msg}
        emit(result)
        return result
    cfg = quick() if args.quick else proportional()
    n = args.images or (4 if args.quick else 8)
    epochs = args.epochs or 1
    repeat = args.repeat or (2 if args.quick else 3)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    batch = args.stage1_batch or max(1, n // 2)
    rounds = args.rounds or (1 if args.quick else 3)
    isolated = not args.quick
    info = machine(args.threads)
    runs: dict[str, dict] = {}
    with workdir_of(args) as wd:
        ws = prepare(wd, cfg, n)
        ds_base = {"spec": {k: (list(v) if isinstance(v, tuple) else v)
                            for k, v in cfg.tiny_spec().__dict__.items()},
                   "repo": str(ws.repo), "resolution": cfg.resolution, "data": str(ws.data),
                   "metadata": str(ws.metadata), "rank": cfg.lora_rank, "drop": template_drop(ws.repo),
                   "epochs": epochs, "repeat": repeat}

        def ds(key, task, models, **kw):
            runs[key] = run_diffsynth(args.ds_python, dict(ds_base, task=task, models=models,
                                                           output=str(fresh(wd / key)), **kw), args.threads)

        def dt(key, *a, **kw):
            runs[key] = run_difftune(train_flags(ws, *a, **kw), isolated, args.threads)

        dt("dt_one", "sft", wd / "dt_one", epochs=epochs, repeat=repeat)
        ds("ds_one", "sft", ["dit", "text_encoder", "vae"])
        dt("dt_s1", "sft:data_process", wd / "dt_s1", components=("text_encoder", "vae"),
           extra=["--data_process_batch_size", batch])
        ds("ds_s1", "sft:data_process", ["text_encoder", "vae"])
        for r in range(rounds):  # stage 2 is where the two are closest: alternate fresh processes
            dt(f"dt_s2_{r}", "sft:train", wd / "dt_s2", dataset=wd / "dt_s1", epochs=epochs, repeat=repeat,
               components=("transformer",))
            ds(f"ds_s2_{r}", "sft:train", ["dit"], cache=str(wd / "ds_s1"))
        if args.diffusers_script:
            runs["df"] = run_child(child_command(args.ds_python, Path(__file__).with_name("peer_diffusers.py"), dict(
                ds_base, script=str(Path(args.diffusers_script).resolve()), output=str(fresh(wd / "df")),
                steps=n * repeat * epochs, prompt=PROMPTS[0])), args.threads)
        dt_cache = cache_bytes(wd / "dt_s1")
        ds_files = ds_cache_files(wd / "ds_s1")
        ds_cache = {"disk_bytes": disk_bytes(wd / "ds_s1"), "samples": len(ds_files)}

    def side(prefix: str, cache: dict, s1_batch: int) -> dict:
        one, s1 = runs[f"{prefix}_one"], runs[f"{prefix}_s1"]
        s2_runs = [runs[f"{prefix}_s2_{r}"] for r in range(rounds)]
        s2 = max(s2_runs, key=lambda run: run["vmhwm_kb"])  # the peak over the rounds
        t_one = step_time(one, warmup)
        t_s2 = statistics.median([x for run in s2_runs for x in step_intervals(run, warmup)])
        return {
            "steps_one_stage": len(one["step_stamps"]), "steps_stage2": len(s2["step_stamps"]),
            "step_time_stage2_per_round_s": [statistics.median(step_intervals(run, warmup)) for run in s2_runs],
            "step_time_one_stage_s": t_one, "step_time_stage2_s": t_s2,
            "steps_per_s_one_stage": 1 / t_one, "steps_per_s_stage2": 1 / t_s2,
            "peak_rss_one_stage_mib": one["vmhwm_kb"] / MIB, "peak_rss_stage1_mib": s1["vmhwm_kb"] / MIB,
            "peak_rss_stage2_mib": s2["vmhwm_kb"] / MIB,
            "baseline_rss_mib": one["rss_before_kb"] / MIB,
            "peak_rss_above_baseline_one_stage_mib": (one["vmhwm_kb"] - one["rss_before_kb"]) / MIB,
            "peak_rss_above_baseline_stage2_mib": (s2["vmhwm_kb"] - s2["rss_before_kb"]) / MIB,
            "stage1_seconds": s1["run_seconds"],
            "stage1_samples_per_s": stage1_rate(s1, s1_batch),
            "cache_bytes_per_sample": cache["disk_bytes"] / max(1, cache["samples"]),
            "cache_samples": cache["samples"],
        }

    dt_side, ds_side = side("dt", dt_cache, batch), side("ds", ds_cache, 1)
    ratios = {
        "step_time_one_stage_ratio": ratio(dt_side["step_time_one_stage_s"], ds_side["step_time_one_stage_s"]),
        "step_time_stage2_ratio": ratio(dt_side["step_time_stage2_s"], ds_side["step_time_stage2_s"]),
        "peak_rss_one_stage_ratio": ratio(dt_side["peak_rss_one_stage_mib"], ds_side["peak_rss_one_stage_mib"]),
        "peak_rss_stage2_ratio": ratio(dt_side["peak_rss_stage2_mib"], ds_side["peak_rss_stage2_mib"]),
        "peak_rss_stage1_ratio": ratio(dt_side["peak_rss_stage1_mib"], ds_side["peak_rss_stage1_mib"]),
        "cache_bytes_ratio": ratio(dt_side["cache_bytes_per_sample"], ds_side["cache_bytes_per_sample"]),
        "stage1_seconds_ratio": ratio(dt_side["stage1_seconds"], ds_side["stage1_seconds"]),
        "stage1_rate_ratio": ratio(dt_side["stage1_samples_per_s"], ds_side["stage1_samples_per_s"]),
    }
    result = {"benchmark": "peers", "peer": "diffsynth 2.1.12", "config": cfg.name, "resolution": cfg.resolution,
              "images": n, "epochs": epochs, "repeat": repeat, "warmup_steps": warmup, "stage1_batch": batch,
              "stage2_rounds": rounds,
              "isolated_processes": True if not args.quick else "diffsynth only",
              "difftune": dt_side, "diffsynth": ds_side, **ratios, "machine": info}
    if "df" in runs:
        df = runs["df"]
        t_df = step_time(df, warmup)
        result["diffusers"] = {"script": str(args.diffusers_script), "steps": len(df["step_stamps"]),
                               "step_time_s": t_df, "steps_per_s": 1 / t_df, "peak_rss_mib": df["vmhwm_kb"] / MIB,
                               "baseline_rss_mib": df["rss_before_kb"] / MIB, "run_seconds": df["run_seconds"]}
        result["step_time_one_stage_ratio_vs_diffusers"] = ratio(dt_side["step_time_one_stage_s"], t_df)
        result["step_time_stage2_ratio_vs_diffusers"] = ratio(dt_side["step_time_stage2_s"], t_df)
        result["peak_rss_one_stage_ratio_vs_diffusers"] = ratio(dt_side["peak_rss_one_stage_mib"],
                                                                df["vmhwm_kb"] / MIB)
        result["peak_rss_stage2_ratio_vs_diffusers"] = ratio(dt_side["peak_rss_stage2_mib"], df["vmhwm_kb"] / MIB)
    else:
        result["diffusers"] = {"skipped": DIFFUSERS_WHY}
    result["targets"] = {
        key: {"target": "<= 1", "value": result[key], "met": result[key] <= 1}
        for key in ("step_time_one_stage_ratio", "step_time_stage2_ratio", "peak_rss_one_stage_ratio",
                    "peak_rss_stage2_ratio", "step_time_stage2_ratio_vs_diffusers",
                    "peak_rss_stage2_ratio_vs_diffusers") if key in result}
    # diffusers' script with --cache_latents encodes once and then steps the DiT alone: its like-for-like
    # mode is difftune's stage 2, so only that pair carries the target; one stage is shown for reference.
    update_doc(resolve_doc(args), "peers", render(result))
    emit(result)
    return result


def render(r: dict) -> str:
    a, b = r["difftune"], r["diffsynth"]
    rows = [
        ["one stage: steps/s", a["steps_per_s_one_stage"], b["steps_per_s_one_stage"],
         r["step_time_one_stage_ratio"], "≤ 1 (step time)", verdict(r["step_time_one_stage_ratio"], 1)],
        ["one stage: peak RSS (MiB)", a["peak_rss_one_stage_mib"], b["peak_rss_one_stage_mib"],
         r["peak_rss_one_stage_ratio"], "≤ 1", verdict(r["peak_rss_one_stage_ratio"], 1)],
        ["stage 2: steps/s", a["steps_per_s_stage2"], b["steps_per_s_stage2"], r["step_time_stage2_ratio"],
         "≤ 1 (step time)", verdict(r["step_time_stage2_ratio"], 1)],
        ["stage 2: peak RSS (MiB)", a["peak_rss_stage2_mib"], b["peak_rss_stage2_mib"], r["peak_rss_stage2_ratio"],
         "≤ 1", verdict(r["peak_rss_stage2_ratio"], 1)],
        ["interpreter + libraries before loading (MiB)", a["baseline_rss_mib"], b["baseline_rss_mib"],
         ratio(a["baseline_rss_mib"], b["baseline_rss_mib"]), "—", "—"],
        ["stage 2: peak RSS above that baseline (MiB)", a["peak_rss_above_baseline_stage2_mib"],
         b["peak_rss_above_baseline_stage2_mib"],
         ratio(a["peak_rss_above_baseline_stage2_mib"], b["peak_rss_above_baseline_stage2_mib"]), "—", "—"],
        ["stage 1: peak RSS (MiB)", a["peak_rss_stage1_mib"], b["peak_rss_stage1_mib"], r["peak_rss_stage1_ratio"],
         "—", "—"],
        ["stage 1: cache bytes per sample on disk", f"{a['cache_bytes_per_sample']:,.0f}",
         f"{b['cache_bytes_per_sample']:,.0f}", r["cache_bytes_ratio"], "—", "—"],
        ["stage 1: whole run (s, model loading included)", a["stage1_seconds"], b["stage1_seconds"],
         r["stage1_seconds_ratio"], "—", "—"],
        ["stage 1: samples/s after the first batch", a["stage1_samples_per_s"], b["stage1_samples_per_s"],
         r["stage1_rate_ratio"], "—", "—"],
    ]
    head = (f"Config `{r['config']}` at {r['resolution']}x{r['resolution']}, {r['images']} images, "
            f"{r['epochs']} epoch(s) x repeat {r['repeat']} ({a['steps_one_stage']} steps per training run), "
            f"first {r['warmup_steps']} step intervals left out, fp32, LoRA rank "
            f"{32 if r['config'] == 'proportional' else 4}, no gradient checkpointing, batch size 1, one "
            f"fresh process per run; stage 2 runs {r['stage2_rounds']} alternating round(s) per trainer, its step "
            f"time is the median over all their steps (per round: difftune "
            f"{' / '.join(f'{x:.3f}' for x in a['step_time_stage2_per_round_s'])} s, DiffSynth "
            f"{' / '.join(f'{x:.3f}' for x in b['step_time_stage2_per_round_s'])} s). "
            f"difftune stage 1 batches {r['stage1_batch']} samples; DiffSynth encodes "
            f"one at a time. Ratios are difftune ÷ DiffSynth {r['peer'].split()[-1]} (for steps/s the ratio "
            f"column is the step-time ratio, so ≤ 1 means difftune is at least as fast).")
    parts = [head, table(["metric", "difftune", "DiffSynth", "difftune ÷ DiffSynth", "target", "verdict"], rows)]
    df = r.get("diffusers", {})
    if "skipped" in df:
        parts.append(f"diffusers' Qwen-Image LoRA script: not measured in this run: {df['skipped']}.")
    elif df:
        parts.append(
            f"diffusers' `train_dreambooth_lora_qwen_image.py` (run unchanged, `--cache_latents`: latents and the "
            f"one `--instance_prompt` embedding are computed once and held in memory, so each step runs the DiT "
            f"alone, like difftune's stage 2; {df['steps']} steps, batch size 1, fp32, same LoRA targets and rank):")
        parts.append(table(["metric", "difftune one stage", "difftune stage 2", "diffusers script",
                            "one stage ÷ diffusers", "stage 2 ÷ diffusers", "target", "verdict"], [
            ["step time (s)", a["step_time_one_stage_s"], a["step_time_stage2_s"], df["step_time_s"],
             r["step_time_one_stage_ratio_vs_diffusers"], r["step_time_stage2_ratio_vs_diffusers"],
             "≤ 1 (stage 2)", verdict(r["step_time_stage2_ratio_vs_diffusers"], 1)],
            ["peak RSS (MiB)", a["peak_rss_one_stage_mib"], a["peak_rss_stage2_mib"], df["peak_rss_mib"],
             r["peak_rss_one_stage_ratio_vs_diffusers"], r["peak_rss_stage2_ratio_vs_diffusers"],
             "≤ 1 (stage 2)", verdict(r["peak_rss_stage2_ratio_vs_diffusers"], 1)]]))
    parts.append(machine_line(r["machine"]))
    return "\n\n".join(parts)


if __name__ == "__main__":
    main()
