"""Ideogram-4: split training against one-stage training on the same model, data and flags.

The Ideogram-4 family at CPU scale with the release's proportions (Qwen3-VL-8B's backbone 0.88x the 9.3B DiT's
parameters, the FLUX.2 AE 0.009x; the unconditional DiT is not loaded for training), three runs of the CLI path,
one process each: `sft` (one stage), `sft:data_process` (stage 1: Qwen3-VL, the AE) and `sft:train` (stage 2: the
DiT alone, from the cache). Also times, in this process, one Qwen3-VL encode of a prompt (all 36 layers, 13 of them
read) and one AE encode of an image, to give their share of a one-stage step. Prints one JSON line; writes its table
to docs/benchmarks.md.

    .venv/bin/python benchmarks/ideogram4_split_vs_unsplit.py            # the proportional model
    .venv/bin/python benchmarks/ideogram4_split_vs_unsplit.py --quick    # smoke run on the tests' tiny model
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (PROMPTS, base_parser, emit, fresh, machine, machine_line,  # noqa: E402
                    median_seconds, param_counts, ratio, resolve_doc, reuse_or_write, run_difftune,
                    split_figures, split_rows, table, update_doc, workdir_of, write_images)

COMPONENTS = ("transformer", "text_encoder", "vae")
REPO = "DiffSynth-Studio/ideogram-4-bf16-repackage"
# the DiT (34 blocks of 4608, SwiGLU 12288, the 53248-wide text projection), Qwen3-VL-8B without its LM head, the
# FLUX.2 AE
REAL = {"transformer": 9.3e9, "text_encoder": 8.15e9, "vae": 0.084e9}


@dataclass
class Ideogram4Bench:
    name: str
    spec: dict  # TinyIdeogram4Spec fields
    resolution: int
    lora_rank: int = 32


def proportional() -> Ideogram4Bench:
    """The DiT at width 256 (2 heads of 128, 4 blocks, its MLP 2.67x the width as the real one's), Qwen3-VL with its
    36 layers at width 64 and an MLP of 400 to reach about 0.88x the DiT, the AE at a width of 8; 256x256 gives 256
    image tokens."""
    return Ideogram4Bench("proportional", dict(head_dim=128, heads=2, layers=4, intermediate=683, adaln_dim=32,
                                               text_hidden=64, text_head_dim=32, text_intermediate=400,
                                               vae_width=8), resolution=256)


def quick() -> Ideogram4Bench:
    return Ideogram4Bench("quick", {}, resolution=64, lora_rank=4)


def prepare(workdir: Path, cfg: Ideogram4Bench, n: int) -> tuple[Path, Path]:
    from support.ideogram4 import TinyIdeogram4Spec, write_tiny_ideogram4_hub

    hub = workdir / f"ideogram4-{cfg.name}"
    reuse_or_write(hub, cfg.spec, lambda hub: write_tiny_ideogram4_hub(hub, TinyIdeogram4Spec(**cfg.spec),
                                                                       tokenizer_beside=True))
    metadata = workdir / f"data-{cfg.resolution}-{n}" / "metadata.csv"
    if not metadata.is_file():
        write_images(metadata.parent, n, cfg.resolution)
    return hub / REPO, metadata


def flags(repo, metadata, cfg, task, output, *, dataset=None, repeat=1, components=COMPONENTS) -> list:
    from difftune.families.ideogram4.components import REFERENCE_LORA_TARGETS

    fresh(output)
    res = str(cfg.resolution)
    paths = [str(next((repo / c).glob("*.safetensors"))) for c in components]
    out = ["--task", task, "--output_path", str(output), "--model_paths", json.dumps(paths),
           "--tokenizer_path", str(repo / "tokenizer"), "--height", res, "--width", res, "--torch_dtype", "float32",
           "--learning_rate", "1e-4", "--num_epochs", "1", "--dataset_repeat", str(repeat), "--lora_base_model",
           "dit", "--lora_target_modules", REFERENCE_LORA_TARGETS, "--lora_rank", str(cfg.lora_rank), "--seed", "0",
           "--no_progress", "--enable_tensorboard_log", "false"]
    if dataset is None:
        return out + ["--dataset_base_path", str(metadata.parent), "--dataset_metadata_path", str(metadata)]
    return out + ["--dataset_base_path", str(dataset)]


def encode_times(repo: Path, cfg: Ideogram4Bench, threads: int, repeats: int = 3) -> dict:
    """Median seconds of one prompt's Qwen3-VL features and one AE encode of an image, fp32, no grad: the stage-1
    work a one-stage step repeats."""
    import torch

    from difftune.families.ideogram4.pipeline import Ideogram4Pipeline
    from difftune.families.ideogram4.units import text_features, vae_encode
    from difftune.models import ModelConfig

    torch.set_num_threads(threads)
    pipe = Ideogram4Pipeline.from_pretrained(
        torch_dtype=torch.float32, model_configs=[ModelConfig(str(next((repo / c).glob("*.safetensors"))))
                                                  for c in ("text_encoder", "vae")],
        tokenizer_config=ModelConfig(str(repo / "tokenizer")))
    image = torch.rand(1, 3, cfg.resolution, cfg.resolution) * 2 - 1
    with torch.no_grad():
        return {"vae_encode_s": median_seconds(lambda: vae_encode(pipe, image), repeats),
                "text_encode_s": median_seconds(lambda: text_features(pipe, PROMPTS[0]), repeats)}


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
                                components=("text_encoder", "vae")), isolated, args.threads)
        s2 = run_difftune(flags(repo, metadata, cfg, "sft:train", wd / "two", dataset=wd / "cache", repeat=repeat,
                                components=("transformer",)), isolated, args.threads)
        enc = encode_times(repo, cfg, args.threads)
    # the reference's lora/Ideogram-4-bf16-repackage.sh trains --num_epochs 5 --dataset_repeat 100
    figures = split_figures(one, s1, s2, warmup, ref_steps=n * 5 * 100, tag="5x100")
    t1, dit = figures["step_time_one_stage_s"], params["transformer"]
    result = {
        "benchmark": "ideogram4_split_vs_unsplit", "config": cfg.name, "resolution": cfg.resolution, "images": n,
        "repeat": repeat, "steps": one["steps"], "warmup_steps": warmup, "isolated_processes": isolated,
        "params": params, "params_over_dit": {k: v / dit for k, v in params.items()},
        "real_params_over_dit": {k: v / REAL["transformer"] for k, v in REAL.items()}, **figures,
        "text_encode_s": enc["text_encode_s"], "vae_encode_s": enc["vae_encode_s"],
        "text_share_of_one_stage_step": ratio(enc["text_encode_s"], t1),
        "vae_share_of_one_stage_step": ratio(enc["vae_encode_s"], t1),
        "cached_share_of_one_stage_step": 1.0 - figures["step_time_stage2_s"] / t1,
        "machine": info,
    }
    update_doc(resolve_doc(args), "ideogram4_split_vs_unsplit", render(result))
    print(f"Ideogram-4 split / one stage: total time {result['total_time_ratio']:.3f} (projected to 5 epochs x "
          f"repeat 100: {result['projected_total_time_ratio_5x100']:.3f}), step time {result['step_time_ratio']:.3f}, "
          f"stage-2 peak RSS {result['peak_rss_ratio']:.3f}; Qwen3-VL encode "
          f"{result['text_share_of_one_stage_step']:.2f} of a one-stage step", file=sys.stderr)
    emit(result)
    return result


def render(r: dict) -> str:
    p, q, real = r["params"], r["params_over_dit"], r["real_params_over_dit"]
    rows = split_rows(r, f"{r['images']} images", ref_repeat=100, tag="5x100")
    head = (f"Config `{r['config']}` at {r['resolution']}x{r['resolution']}: DiT {p['transformer'] / 1e6:.2f}M, "
            f"Qwen3-VL {p['text_encoder'] / 1e6:.2f}M ({q['text_encoder']:.3f}x the DiT; the release "
            f"{real['text_encoder']:.3f}x), AE {p['vae'] / 1e6:.3f}M ({q['vae']:.4f}x; real {real['vae']:.4f}x); "
            f"LoRA rank {r.get('lora_rank', 32 if r['config'] != 'quick' else 4)} on the reference's targets; fp32; "
            f"stage 1 took {r['stage1_seconds']:.1f} s (model loading included), peak RSS "
            f"{r['peak_rss_stage1_mib']:.0f} MiB. The work stage 2 leaves out is "
            f"{100 * r['cached_share_of_one_stage_step']:.0f}% of a one-stage step (1 - the step-time ratio). Timed "
            f"apart afterwards, one Qwen3-VL encode of a prompt takes {r['text_encode_s']:.3f} s "
            f"({100 * r['text_share_of_one_stage_step']:.0f}% of a one-stage step) and one AE encode of an image "
            f"{r['vae_encode_s']:.3f} s ({100 * r['vae_share_of_one_stage_step']:.0f}%).")
    return "\n\n".join([head, table(["metric", "one stage", "split (stage 2)", "split ÷ one stage"], rows),
                        machine_line(r["machine"])])


if __name__ == "__main__":
    main()
