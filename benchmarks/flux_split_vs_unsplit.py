"""FLUX.1: split training against one-stage training on the same model, data and flags.

The FLUX.1 family at CPU scale with FLUX.1-dev's proportions (T5-XXL 0.39x the DiT's parameters, CLIP-L 0.01x,
the AE 0.007x: 4.7B, 0.12B and 0.08B against 12B), three runs of the CLI path, one process each: `sft` (one
stage), `sft:data_process` (stage 1: CLIP, T5, AE) and `sft:train` (stage 2: the DiT alone, from the cache).
Prints one JSON line (the ratios side by side); writes its table to docs/benchmarks.md.

    .venv/bin/python benchmarks/flux_split_vs_unsplit.py            # the proportional model (a few minutes here)
    .venv/bin/python benchmarks/flux_split_vs_unsplit.py --quick    # smoke run on the tests' tiny model
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (base_parser, emit, fresh, machine, machine_line, param_counts, resolve_doc,  # noqa: E402
                    reuse_or_write, run_difftune, split_figures, split_rows, table, update_doc, workdir_of,
                    write_images)

COMPONENTS = ("transformer", "text_encoder", "text_encoder_2", "vae")
REAL = {"text_encoder_2": 4.7e9, "text_encoder": 0.123e9, "vae": 0.084e9, "transformer": 11.9e9}


@dataclass
class FluxBench:
    name: str
    spec: dict  # TinyFluxSpec fields
    resolution: int
    lora_rank: int = 32


def proportional() -> FluxBench:
    """Head width 128 and rope axes (16, 56, 56) as FLUX.1's DiT, double:single blocks 1:2 as its 19:38; the T5
    encoder has 0.39x the DiT's parameters (gated-GELU, 4 heads of 64), CLIP and the AE about 0.01x each.
    256x256 gives 256 image tokens next to T5's 512 prompt tokens."""
    return FluxBench("proportional", dict(
        num_layers=2, num_single_layers=4, num_attention_heads=2, attention_head_dim=128, axes_dims_rope=(16, 56, 56),
        clip_hidden=64, clip_layers=2, clip_intermediate=110, t5_hidden=256, t5_layers=4, t5_heads=4, t5_d_kv=64,
        t5_d_ff=820, vae_channels=12), resolution=256)


def quick() -> FluxBench:
    return FluxBench("quick", {}, resolution=64, lora_rank=4)


def prepare(workdir: Path, cfg: FluxBench, n: int) -> tuple[Path, Path]:
    from support import TinyFluxSpec, write_tiny_flux

    repo = workdir / f"flux-{cfg.name}"
    reuse_or_write(repo, cfg.spec, lambda repo: write_tiny_flux(repo, TinyFluxSpec(**cfg.spec), shard=False))
    metadata = workdir / f"data-{cfg.resolution}-{n}" / "metadata.csv"
    if not metadata.is_file():
        write_images(metadata.parent, n, cfg.resolution)
    return repo, metadata


def model_paths(repo: Path, components) -> str:
    from support import tiny_flux_paths

    paths = tiny_flux_paths(repo)
    return json.dumps([paths[c] if len(paths[c]) > 1 else paths[c][0] for c in components])


def flags(repo, metadata, cfg, task, output, *, dataset=None, epochs=1, repeat=1, components=COMPONENTS) -> list:
    from difftune.families.flux.components import LORA_TARGET_MODULES

    fresh(output)
    res = str(cfg.resolution)
    out = ["--task", task, "--output_path", str(output), "--model_paths", model_paths(repo, components),
           "--height", res, "--width", res, "--torch_dtype", "float32", "--learning_rate", "1e-4",
           "--num_epochs", str(epochs), "--dataset_repeat", str(repeat), "--lora_base_model", "dit",
           "--lora_target_modules", LORA_TARGET_MODULES, "--lora_rank", str(cfg.lora_rank), "--seed", "0",
           "--no_progress", "--enable_tensorboard_log", "false"]
    if dataset is None:
        return out + ["--dataset_base_path", str(metadata.parent), "--dataset_metadata_path", str(metadata)]
    return out + ["--dataset_base_path", str(dataset)]


def main(argv=None) -> dict:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=None)
    p.add_argument("--repeat", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None, help="step intervals left out of the step time")
    args = p.parse_args(argv)
    cfg = quick() if args.quick else proportional()
    n = args.images or (2 if args.quick else 4)
    repeat = args.repeat or (2 if args.quick else 4)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    isolated = not args.quick
    info = machine(args.threads)
    with workdir_of(args) as wd:
        repo, metadata = prepare(wd, cfg, n)
        params = param_counts(repo, {c: f"{c}/*.safetensors" for c in COMPONENTS})
        one = run_difftune(flags(repo, metadata, cfg, "sft", wd / "one", repeat=repeat), isolated, args.threads)
        s1 = run_difftune(flags(repo, metadata, cfg, "sft:data_process", wd / "cache",
                                components=("text_encoder", "text_encoder_2", "vae")), isolated, args.threads)
        s2 = run_difftune(flags(repo, metadata, cfg, "sft:train", wd / "two", dataset=wd / "cache", repeat=repeat,
                                components=("transformer",)), isolated, args.threads)
    # the reference's FLUX.1-dev.sh trains --num_epochs 5 --dataset_repeat 50
    figures = split_figures(one, s1, s2, warmup, ref_steps=n * 5 * 50, tag="5x50")
    dit = params["transformer"]
    result = {
        "benchmark": "flux_split_vs_unsplit", "config": cfg.name, "resolution": cfg.resolution, "images": n,
        "repeat": repeat, "steps": one["steps"], "warmup_steps": warmup, "isolated_processes": isolated,
        "params": params, "params_over_dit": {k: v / dit for k, v in params.items()},
        "real_params_over_dit": {k: v / REAL["transformer"] for k, v in REAL.items()}, **figures,
        "machine": info,
    }
    update_doc(resolve_doc(args), "flux_split_vs_unsplit", render(result))
    print(f"FLUX split / one stage: total time {result['total_time_ratio']:.3f} (projected to 5 epochs x repeat 50: "
          f"{result['projected_total_time_ratio_5x50']:.3f}), step time "
          f"{result['step_time_ratio']:.3f}, stage-2 peak RSS {result['peak_rss_ratio']:.3f} "
          f"({result['peak_rss_above_baseline_ratio']:.3f} above the baseline)", file=sys.stderr)
    emit(result)
    return result


def render(r: dict) -> str:
    p, q = r["params"], r["params_over_dit"]
    rows = split_rows(r, f"{r['images']} images", ref_repeat=50, tag="5x50")
    head = (f"Config `{r['config']}` at {r['resolution']}x{r['resolution']}: DiT {p['transformer'] / 1e6:.2f}M, "
            f"T5 {p['text_encoder_2'] / 1e6:.2f}M ({q['text_encoder_2']:.3f}x the DiT; FLUX.1-dev "
            f"{r['real_params_over_dit']['text_encoder_2']:.3f}x), CLIP {p['text_encoder'] / 1e6:.3f}M "
            f"({q['text_encoder']:.4f}x; real {r['real_params_over_dit']['text_encoder']:.4f}x), AE "
            f"{p['vae'] / 1e6:.3f}M ({q['vae']:.4f}x; real {r['real_params_over_dit']['vae']:.4f}x); LoRA rank 32 on "
            f"FLUX's default targets; fp32; T5 prompts padded to 512 tokens; stage 1 took {r['stage1_seconds']:.1f} s "
            f"(model loading included), peak RSS {r['peak_rss_stage1_mib']:.0f} MiB.")
    return "\n\n".join([head, table(["metric", "one stage", "split (stage 2)", "split ÷ one stage"], rows),
                        machine_line(r["machine"])])


if __name__ == "__main__":
    main()
