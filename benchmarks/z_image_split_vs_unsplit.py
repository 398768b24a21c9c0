"""Z-Image: split training against one-stage training on the same model, data and flags.

The Z-Image family at CPU scale with Z-Image-Turbo's proportions (the Qwen3-4B text encoder 0.65x the 6.15B DiT's
parameters, the FLUX.1 AE 0.014x), three runs of the CLI path, one process each: `sft` (one stage),
`sft:data_process` (stage 1: Qwen3, the AE) and `sft:train` (stage 2: the DiT alone, from the cache). Also times,
in this process, one Qwen3 encode of a prompt (padded to 512 tokens, as diffusers and the reference encode it) and
one AE encode of an image, to give their share of a one-stage step. Prints one JSON line (the ratios side by side);
writes its table to docs/benchmarks.md.

    .venv/bin/python benchmarks/z_image_split_vs_unsplit.py            # the proportional model (a few minutes here)
    .venv/bin/python benchmarks/z_image_split_vs_unsplit.py --quick    # smoke run on the tests' tiny model
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (PROMPTS, base_parser, emit, fresh, machine, machine_line, median_seconds, param_counts,  # noqa: E402
                    ratio, resolve_doc, reuse_or_write, run_difftune, split_figures, split_rows, table, update_doc,
                    workdir_of, write_images)

COMPONENTS = ("transformer", "text_encoder", "vae")
# Z-Image-Turbo: the S3-DiT, Qwen3-4B (tied embeddings, loaded without an LM head), the FLUX.1 AE
REAL = {"transformer": 6.15e9, "text_encoder": 4.02e9, "vae": 0.0838e9}


@dataclass
class ZImageBench:
    name: str
    spec: dict  # TinyZImageSpec fields
    resolution: int
    lora_rank: int = 32


def proportional() -> ZImageBench:
    """Heads of 128 and rope axes (32, 48, 48) as Z-Image's DiT (2 heads, 4 layers and 2 + 2 refiners against 30
    heads, 30 layers and 2 + 2), Qwen3 with heads of 128 and its MLP at 3.3x the width (the real one's 3.8x) to
    reach 0.65x the DiT, the AE at about FLUX.1's 0.014x; 256x256 gives 256 image tokens."""
    return ZImageBench("proportional", dict(
        dim=256, n_heads=2, axes_dims=(32, 48, 48), n_layers=4, n_refiner_layers=2,
        text_hidden=384, text_layers=3, text_heads=3, text_head_dim=128, text_intermediate=1250,
        vae_channels=16), resolution=256)


def quick() -> ZImageBench:
    return ZImageBench("quick", {}, resolution=64, lora_rank=4)


def prepare(workdir: Path, cfg: ZImageBench, n: int) -> tuple[Path, Path]:
    from support import TinyZImageSpec, write_tiny_z_image_turbo

    repo = workdir / f"z-image-{cfg.name}"
    reuse_or_write(repo, cfg.spec,
                   lambda repo: write_tiny_z_image_turbo(repo, TinyZImageSpec(**cfg.spec), shard=False))
    metadata = workdir / f"data-{cfg.resolution}-{n}" / "metadata.csv"
    if not metadata.is_file():
        write_images(metadata.parent, n, cfg.resolution)
    return repo, metadata


def flags(repo, metadata, cfg, task, output, *, dataset=None, repeat=1, components=COMPONENTS) -> list:
    from difftune.families.z_image.components import LORA_TARGET_MODULES

    fresh(output)
    res = str(cfg.resolution)
    paths = [str(next((repo / c).glob("*.safetensors"))) for c in components]
    out = ["--task", task, "--output_path", str(output), "--model_paths", json.dumps(paths),
           "--tokenizer_path", str(repo / "tokenizer"), "--height", res, "--width", res, "--torch_dtype", "float32",
           "--learning_rate", "1e-4", "--num_epochs", "1", "--dataset_repeat", str(repeat), "--lora_base_model",
           "dit", "--lora_target_modules", LORA_TARGET_MODULES, "--lora_rank", str(cfg.lora_rank), "--seed", "0",
           "--no_progress", "--enable_tensorboard_log", "false"]
    if dataset is None:
        return out + ["--dataset_base_path", str(metadata.parent), "--dataset_metadata_path", str(metadata)]
    return out + ["--dataset_base_path", str(dataset)]


def encode_times(repo: Path, cfg: ZImageBench, threads: int, repeats: int = 3) -> dict:
    """Median seconds of one Qwen3 encode of a prompt (512 tokens, second-to-last hidden states) and one AE encode
    of an image, fp32, no grad: the stage-1 work a one-stage step repeats."""
    import torch
    from diffusers import AutoencoderKL
    from transformers import AutoTokenizer, Qwen3Model

    torch.set_num_threads(threads)
    vae = AutoencoderKL.from_pretrained(repo / "vae").eval()
    qwen = Qwen3Model.from_pretrained(repo / "text_encoder").eval()
    tok = AutoTokenizer.from_pretrained(repo / "tokenizer")
    image = torch.rand(1, 3, cfg.resolution, cfg.resolution) * 2 - 1
    ids = tok([f"<|im_start|>user\n{PROMPTS[0]}<|im_end|>\n<|im_start|>assistant\n"], padding="max_length",
              max_length=512, truncation=True, return_tensors="pt")


    return {"vae_encode_s": median_seconds(lambda: vae.encode(image).latent_dist.mode(), repeats),
            "qwen3_encode_s": median_seconds(lambda: qwen(ids.input_ids, attention_mask=ids.attention_mask.bool(),
                                                          output_hidden_states=True), repeats)}


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
    # the reference's lora/Z-Image-Turbo.sh trains --num_epochs 5 --dataset_repeat 50
    figures = split_figures(one, s1, s2, warmup, ref_steps=n * 5 * 50, tag="5x50")
    t1, dit = figures["step_time_one_stage_s"], params["transformer"]
    result = {
        "benchmark": "z_image_split_vs_unsplit", "config": cfg.name, "resolution": cfg.resolution, "images": n,
        "repeat": repeat, "steps": one["steps"], "warmup_steps": warmup, "isolated_processes": isolated,
        "params": params, "params_over_dit": {k: v / dit for k, v in params.items()},
        "real_params_over_dit": {k: v / REAL["transformer"] for k, v in REAL.items()}, **figures,
        "qwen3_encode_s": enc["qwen3_encode_s"], "vae_encode_s": enc["vae_encode_s"],
        "qwen3_share_of_one_stage_step": ratio(enc["qwen3_encode_s"], t1),
        "vae_share_of_one_stage_step": ratio(enc["vae_encode_s"], t1),
        "cached_share_of_one_stage_step": 1.0 - figures["step_time_stage2_s"] / t1,
        "machine": info,
    }
    update_doc(resolve_doc(args), "z_image_split_vs_unsplit", render(result))
    print(f"Z-Image split / one stage: total time {result['total_time_ratio']:.3f} (projected to 5 epochs x repeat "
          f"50: {result['projected_total_time_ratio_5x50']:.3f}), step time {result['step_time_ratio']:.3f}, "
          f"stage-2 peak RSS {result['peak_rss_ratio']:.3f} ({result['peak_rss_above_baseline_ratio']:.3f} above "
          f"the baseline); Qwen3 encode {result['qwen3_share_of_one_stage_step']:.2f} of a one-stage step",
          file=sys.stderr)
    emit(result)
    return result


def render(r: dict) -> str:
    p, q, real = r["params"], r["params_over_dit"], r["real_params_over_dit"]
    rows = split_rows(r, f"{r['images']} images", ref_repeat=50, tag="5x50")
    head = (f"Config `{r['config']}` at {r['resolution']}x{r['resolution']}: DiT {p['transformer'] / 1e6:.2f}M, "
            f"Qwen3 {p['text_encoder'] / 1e6:.2f}M ({q['text_encoder']:.3f}x the DiT; Z-Image-Turbo "
            f"{real['text_encoder']:.3f}x), AE {p['vae'] / 1e6:.3f}M ({q['vae']:.4f}x; real {real['vae']:.4f}x); "
            f"LoRA rank {32 if r['config'] != 'quick' else 4} on to_q,to_k,to_v,to_out.0,w1,w2,w3; fp32; prompts "
            f"padded to 512 tokens for Qwen3; stage 1 took {r['stage1_seconds']:.1f} s (model loading included), "
            f"peak RSS {r['peak_rss_stage1_mib']:.0f} MiB. The work stage 2 leaves out is "
            f"{100 * r['cached_share_of_one_stage_step']:.0f}% of a one-stage step (1 - the step-time ratio). "
            f"Timed apart in the benchmark's own process afterwards, one Qwen3 encode of a prompt takes "
            f"{r['qwen3_encode_s']:.3f} s ({100 * r['qwen3_share_of_one_stage_step']:.0f}% of a one-stage step) and "
            f"one AE encode of an image {r['vae_encode_s']:.3f} s ({100 * r['vae_share_of_one_stage_step']:.0f}%).")
    return "\n\n".join([head, table(["metric", "one stage", "split (stage 2)", "split ÷ one stage"], rows),
                        machine_line(r["machine"])])


if __name__ == "__main__":
    main()
