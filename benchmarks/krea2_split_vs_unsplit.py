"""Krea-2: split training against one-stage training on the same model, data and flags.

The Krea-2 family at CPU scale with Krea-2-Raw's proportions (the Qwen3-VL-4B text encoder 0.35x the 12.8B DiT's
parameters, the Qwen-Image VAE 0.010x), three runs of the CLI path, one process each: `sft` (one stage),
`sft:data_process` (stage 1: Qwen3-VL, the VAE) and `sft:train` (stage 2: the DiT alone, from the cache). Also
times, in this process, one Qwen3-VL encode of a prompt (the 12 tapped hidden states of the 546-token sequence
diffusers and the reference encode) and one VAE encode of an image, to give their share of a one-stage step.
Prints one JSON line (the ratios side by side); writes its table to docs/benchmarks.md.

    .venv/bin/python benchmarks/krea2_split_vs_unsplit.py            # the proportional model (minutes here)
    .venv/bin/python benchmarks/krea2_split_vs_unsplit.py --quick    # smoke run on the tests' tiny model
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (base_parser, emit, fresh, machine, machine_line, median_seconds, param_counts,  # noqa: E402
                    ratio, resolve_doc, reuse_or_write, run_difftune, split_figures, split_rows, table, update_doc,
                    workdir_of, write_images)

COMPONENTS = {"transformer": "krea/Krea-2-Raw/raw.safetensors",
              "text_encoder": "Qwen/Qwen3-VL-4B-Instruct/model.safetensors",
              "vae": "Qwen/Qwen-Image/vae/diffusion_pytorch_model.safetensors"}
# Krea-2-Raw's DiT, Qwen3-VL-4B-Instruct loaded as Qwen3VLModel (no LM head), the Qwen-Image VAE
REAL = {"transformer": 12.82e9, "text_encoder": 4.438e9, "vae": 0.1269e9}


@dataclass
class Krea2Bench:
    name: str
    dit: dict = field(default_factory=dict)  # TinyKrea2Spec fields
    text: dict = field(default_factory=dict)  # TinyQwen3VLSpec fields
    vae_base_dim: int = 8
    resolution: int = 64
    lora_rank: int = 32


def proportional() -> Krea2Bench:
    """Heads of 128 with 4:1 grouped queries and the MLP at 2.67x as Krea-2's DiT (4 heads, 4 layers against 48 and
    28); Qwen3-VL with its 36 layers (the DiT reads states up to the 35th) at a width that makes it 0.33x the DiT,
    its MLP at 3.8x as the 4B's; the VAE at about the real 0.01x; 256x256 gives 256 image tokens."""
    return Krea2Bench("proportional",
                      dit=dict(hidden_heads=4, head_dim=128, kv_heads=1, layers=4, intermediate=1367, text_hidden=96,
                               text_heads=1, text_intermediate=259),
                      text=dict(hidden=96, layers=36, heads=3, kv_heads=1, head_dim=32, intermediate=365,
                                vision_hidden=32, vision_depth=1),
                      vae_base_dim=12, resolution=256)


def quick() -> Krea2Bench:
    return Krea2Bench("quick", resolution=64, lora_rank=4)


def prepare(workdir: Path, cfg: Krea2Bench, n: int) -> tuple[Path, Path]:
    from support.krea2.tiny import KREA2_TEXT_SPEC, TinyKrea2Spec, write_tiny_krea2_hub
    from support.qwen_parts import TinyQwen3VLSpec

    repo = workdir / f"krea2-{cfg.name}"
    text = TinyQwen3VLSpec(**cfg.text) if cfg.text else KREA2_TEXT_SPEC
    reuse_or_write(repo, {"dit": cfg.dit, "text": cfg.text, "vae": cfg.vae_base_dim},
                   lambda repo: write_tiny_krea2_hub(repo, TinyKrea2Spec(**cfg.dit), text, cfg.vae_base_dim,
                                                     turbo=False))
    metadata = workdir / f"data-{cfg.resolution}-{n}" / "metadata.csv"
    if not metadata.is_file():
        write_images(metadata.parent, n, cfg.resolution)
    return repo, metadata


def flags(repo, metadata, cfg, task, output, *, dataset=None, repeat=1, components=tuple(COMPONENTS)) -> list:
    from difftune.families.krea2.components import LORA_TARGET_MODULES

    fresh(output)
    res = str(cfg.resolution)
    paths = [str(repo / COMPONENTS[c]) for c in components]
    out = ["--task", task, "--output_path", str(output), "--model_paths", json.dumps(paths),
           "--tokenizer_path", str(repo / "Qwen" / "Qwen3-VL-4B-Instruct"), "--height", res, "--width", res,
           "--torch_dtype", "float32", "--learning_rate", "1e-4", "--num_epochs", "1", "--dataset_repeat",
           str(repeat), "--lora_base_model", "dit", "--lora_target_modules", LORA_TARGET_MODULES, "--lora_rank",
           str(cfg.lora_rank), "--seed", "0", "--no_progress", "--enable_tensorboard_log", "false"]
    if dataset is None:
        return out + ["--dataset_base_path", str(metadata.parent), "--dataset_metadata_path", str(metadata)]
    return out + ["--dataset_base_path", str(dataset)]


def encode_times(repo: Path, cfg: Krea2Bench, threads: int, repeats: int = 3) -> dict:
    """Median seconds of one Qwen3-VL prompt encode (the family's own, 12 tapped states) and one VAE encode of an
    image, fp32, no grad: the stage-1 work a one-stage step repeats."""
    import torch

    from difftune.families.krea2.prompt import text_hidden_states
    from support.krea2.tiny import load_tiny_krea2

    torch.set_num_threads(threads)
    pipe = load_tiny_krea2(repo)
    image = torch.rand(1, 3, 1, cfg.resolution, cfg.resolution) * 2 - 1
    return {"vae_encode_s": median_seconds(lambda: pipe.vae.encode(image).latent_dist.mode(), repeats),
            "qwen3_vl_encode_s": median_seconds(lambda: text_hidden_states(pipe, ["a photo of a cat on a sofa"]),
                                                repeats)}


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
        params = param_counts(repo, COMPONENTS)
        one = run_difftune(flags(repo, metadata, cfg, "sft", wd / "one", repeat=repeat), isolated, args.threads)
        s1 = run_difftune(flags(repo, metadata, cfg, "sft:data_process", wd / "cache",
                                components=("text_encoder", "vae")), isolated, args.threads)
        s2 = run_difftune(flags(repo, metadata, cfg, "sft:train", wd / "two", dataset=wd / "cache", repeat=repeat,
                                components=("transformer",)), isolated, args.threads)
        enc = encode_times(repo, cfg, args.threads)
    # the reference's lora/Krea-2-Raw.sh trains --num_epochs 5 --dataset_repeat 50
    figures = split_figures(one, s1, s2, warmup, ref_steps=n * 5 * 50, tag="5x50")
    t1, dit = figures["step_time_one_stage_s"], params["transformer"]
    result = {
        "benchmark": "krea2_split_vs_unsplit", "config": cfg.name, "resolution": cfg.resolution, "images": n,
        "repeat": repeat, "steps": one["steps"], "warmup_steps": warmup, "isolated_processes": isolated,
        "params": params, "params_over_dit": {k: v / dit for k, v in params.items()},
        "real_params_over_dit": {k: v / REAL["transformer"] for k, v in REAL.items()}, **figures,
        "qwen3_vl_encode_s": enc["qwen3_vl_encode_s"], "vae_encode_s": enc["vae_encode_s"],
        "qwen3_vl_share_of_one_stage_step": ratio(enc["qwen3_vl_encode_s"], t1),
        "vae_share_of_one_stage_step": ratio(enc["vae_encode_s"], t1),
        "cached_share_of_one_stage_step": 1.0 - figures["step_time_stage2_s"] / t1,
        "machine": info,
    }
    update_doc(resolve_doc(args), "krea2_split_vs_unsplit", render(result))
    print(f"Krea-2 split / one stage: total time {result['total_time_ratio']:.3f} (projected to 5 epochs x repeat "
          f"50: {result['projected_total_time_ratio_5x50']:.3f}), step time {result['step_time_ratio']:.3f}, "
          f"stage-2 peak RSS {result['peak_rss_ratio']:.3f}; Qwen3-VL encode "
          f"{result['qwen3_vl_share_of_one_stage_step']:.2f} of a one-stage step", file=sys.stderr)
    emit(result)
    return result


def render(r: dict) -> str:
    p, q, real = r["params"], r["params_over_dit"], r["real_params_over_dit"]
    rows = split_rows(r, f"{r['images']} images", ref_repeat=50, tag="5x50")
    head = (f"Config `{r['config']}` at {r['resolution']}x{r['resolution']}: DiT {p['transformer'] / 1e6:.2f}M, "
            f"Qwen3-VL {p['text_encoder'] / 1e6:.2f}M ({q['text_encoder']:.3f}x the DiT; Krea-2-Raw "
            f"{real['text_encoder']:.3f}x), VAE {p['vae'] / 1e6:.3f}M ({q['vae']:.4f}x; real {real['vae']:.4f}x); "
            f"LoRA rank {32 if r['config'] != 'quick' else 4} on the reference's targets; fp32; prompts encoded "
            f"at 512 tokens, their real tokens kept; stage 1 took {r['stage1_seconds']:.1f} s (model loading "
            f"included), peak RSS "
            f"{r['peak_rss_stage1_mib']:.0f} MiB. The work stage 2 leaves out is "
            f"{100 * r['cached_share_of_one_stage_step']:.0f}% of a one-stage step (1 - the step-time ratio). "
            f"Timed apart afterwards, one Qwen3-VL encode of a prompt takes {r['qwen3_vl_encode_s']:.3f} s "
            f"({100 * r['qwen3_vl_share_of_one_stage_step']:.0f}% of a one-stage step) and one VAE encode of an image "
            f"{r['vae_encode_s']:.3f} s ({100 * r['vae_share_of_one_stage_step']:.0f}%).")
    return "\n\n".join([head, table(["metric", "one stage", "split (stage 2)", "split ÷ one stage"], rows),
                        machine_line(r["machine"])])


if __name__ == "__main__":
    main()
