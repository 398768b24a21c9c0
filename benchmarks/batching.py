"""Batching: stage-2 samples/s at --batch_size 1, 2 and 4 on a mixed-aspect data set, and stage 1 batched
against one sample at a time, as ratios measured in one run.

The data set has three aspect ratios (square, landscape, portrait, at the config's pixel count) and prompts of
different lengths, so batches come from buckets and prompts are padded. Stage 1 runs twice (batched and one at
a time) into fresh caches; stage 2 trains from the batched cache at each batch size, each run in a fresh
process. Samples/s = samples per optimizer step / median step time after warm-up.

    .venv/bin/python benchmarks/batching.py            # the proportional model (a few minutes here)
    .venv/bin/python benchmarks/batching.py --quick    # smoke run on the tests' tiny model
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (PROMPTS, base_parser, emit, fresh, machine, machine_line, prepare, proportional,  # noqa: E402
                    quick, ratio, resolve_doc, run_difftune, stage1_rate, step_time, table, train_flags,
                    update_doc, workdir_of)

BATCHES = (1, 2, 4)


def write_mixed(root: Path, n: int, size: int) -> Path:
    """`n` images in three aspect ratios of about size x size pixels (sides multiples of 16), prompts of
    one to three sentences."""
    import numpy as np
    from PIL import Image

    short = size * 3 // 4 // 16 * 16
    shapes = [(size, size), (size, short), (short, size)]
    fresh(root).mkdir(parents=True)
    rng = np.random.default_rng(1)
    lines = ["image,prompt"]
    for i in range(n):
        w, h = shapes[i % 3]
        arr = rng.normal(128, 40, (h, w, 3)).clip(0, 255).astype("uint8")
        Image.fromarray(arr).save(root / f"m_{i:03d}.png")
        prompt = ", ".join(PROMPTS[(i + k) % len(PROMPTS)] for k in range(1 + i % 3))
        lines.append(f'm_{i:03d}.png,"{prompt}"')
    (root / "metadata.csv").write_text("\n".join(lines) + "\n")
    return root / "metadata.csv"


def dynamic(flags: list[str], max_pixels: int) -> list[str]:
    """The same flags at dynamic resolution: no fixed --height/--width, images kept under max_pixels."""
    out, skip = [], False
    for f in flags:
        if skip:
            skip = False
            continue
        if f in ("--height", "--width"):
            skip = True
            continue
        out.append(f)
    return out + ["--max_pixels", str(max_pixels)]


def main(argv=None) -> dict:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=None, help="default 48 (12 with --quick)")
    p.add_argument("--steps", type=int, default=None, help="optimizer steps per stage-2 run (default 12; 6 --quick)")
    args = p.parse_args(argv)
    cfg = quick() if args.quick else proportional()
    n = args.images or (12 if args.quick else 48)
    steps = args.steps or (6 if args.quick else 12)
    warmup = 2
    isolated = not args.quick
    info = machine(args.threads)
    pixels = cfg.resolution * cfg.resolution
    with workdir_of(args) as wd:
        ws = prepare(wd, cfg, 2)  # the model (its own images are not used)
        meta = write_mixed(wd / f"mixed-{cfg.resolution}-{n}", n, cfg.resolution)
        stage1 = {}
        for b in (1, 8):
            flags = train_flags(ws, "sft:data_process", wd / f"cache-b{b}", components=("text_encoder", "vae"),
                                extra=["--data_process_batch_size", b])
            flags = dynamic(flags, pixels)
            flags[flags.index("--dataset_base_path") + 1] = str(meta.parent)
            flags[flags.index("--dataset_metadata_path") + 1] = str(meta)
            stage1[b] = run_difftune(flags, isolated, args.threads)
        stage2 = {}
        for b in BATCHES:
            repeat = -(-steps * b * 2 // n)  # enough samples for `steps` steps of full batches, roughly
            flags = train_flags(ws, "sft:train", wd / f"out-b{b}", dataset=wd / "cache-b8", repeat=repeat,
                                components=("transformer",),
                                extra=["--batch_size", b, "--max_steps", steps, "--save_steps", 10_000])
            stage2[b] = run_difftune(dynamic(flags, pixels), isolated, args.threads)
    per_s = {b: b / step_time(stage2[b], warmup) for b in BATCHES}
    s1_one, s1_batched = stage1_rate(stage1[1], 1), stage1_rate(stage1[8], 8)
    result = {
        "benchmark": "batching", "config": cfg.name, "pixels": pixels, "images": n, "steps_per_run": steps,
        "warmup_steps": warmup, "isolated_processes": isolated,
        **{f"stage2_samples_per_s_batch{b}": per_s[b] for b in BATCHES},
        **{f"stage2_speedup_batch{b}": ratio(per_s[b], per_s[1]) for b in BATCHES if b != 1},
        **{f"stage2_peak_rss_batch{b}_mib": stage2[b]["vmhwm_kb"] / 1024 for b in BATCHES},
        "stage1_samples_per_s_one_at_a_time": s1_one, "stage1_samples_per_s_batched_8": s1_batched,
        "stage1_batched_speedup": ratio(s1_batched, s1_one), "machine": info,
    }
    update_doc(resolve_doc(args), "batching", render(result))
    emit(result)
    return result


def render(r: dict) -> str:
    rows = [[f"stage 2 samples/s, batch {b}", r[f"stage2_samples_per_s_batch{b}"],
             r.get(f"stage2_speedup_batch{b}", 1.0), r[f"stage2_peak_rss_batch{b}_mib"]] for b in BATCHES]
    rows.append(["stage 1 samples/s, one at a time / batches of 8",
                 f"{r['stage1_samples_per_s_one_at_a_time']:.3g} / {r['stage1_samples_per_s_batched_8']:.3g}",
                 r["stage1_batched_speedup"], "—"])
    head = (f"Config `{r['config']}`: {r['images']} images in three aspect ratios (about {r['pixels']} pixels "
            f"each) with prompts of one to three sentences; stage 2 from the batched cache, {r['steps_per_run']} "
            f"steps per run, the first {r['warmup_steps']} left out. Buckets: one per aspect ratio.")
    return "\n\n".join([head, table(["measure", "value", "÷ batch 1 (stage 1: ÷ one at a time)", "peak RSS (MiB)"],
                                    rows), machine_line(r["machine"])])


if __name__ == "__main__":
    main()
