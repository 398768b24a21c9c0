"""Wan (video): split training against one-stage training on the same model, clips and flags.

The Wan family at CPU scale with Wan2.1-T2V-1.3B's proportions (UMT5-XXL's encoder 4.4x the DiT's parameters,
the Wan2.1 VAE 0.1x: 5.7B and 0.13B against 1.3B; the VAE keeps Wan2.1's structure, two blocks per level at
widths x1, x2, x4, x4), three runs of the CLI path, one process each: `sft` (one stage), `sft:data_process`
(stage 1: UMT5, the VAE) and `sft:train` (stage 2: the DiT alone, from the cache). Also times, in this process,
one VAE encode of a clip and one UMT5 encode of a prompt, to give their share of a one-stage step.
Prints one JSON line (the ratios side by side); writes its table to docs/benchmarks.md.

    .venv/bin/python benchmarks/wan_split_vs_unsplit.py            # the proportional model (a few minutes here)
    .venv/bin/python benchmarks/wan_split_vs_unsplit.py --quick    # smoke run on the tests' tiny model
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (base_parser, emit, fresh, machine, machine_line, median_seconds, param_counts, ratio,  # noqa: E402
                    resolve_doc, reuse_or_write, run_difftune, split_figures, split_rows, table, update_doc, workdir_of)

COMPONENTS = ("transformer", "text_encoder", "vae")
REAL = {"transformer": 1.3e9, "text_encoder": 5.7e9, "vae": 0.13e9}  # Wan2.1-T2V-1.3B


@dataclass
class WanBench:
    name: str
    spec: dict  # TinyWanSpec fields
    resolution: int
    num_frames: int
    lora_rank: int = 32


def proportional() -> WanBench:
    """Heads of 128 as Wan's DiT (3 of them; ffn 5.8x the width as its 8960 / 1536), UMT5 with heads of 64 (d_ff 2.9x
    d_model against UMT5-XXL's 2.5x, to reach its 4.4x the DiT); 17 frames at 128x128 give 5 latent frames of 8x8 patches."""
    return WanBench("proportional", dict(
        num_layers=3, num_attention_heads=3, attention_head_dim=128, ffn_dim=2240, text_dim=768,
        vae_base_dim=8, vae_res_blocks=2, vae_dim_mult=(1, 2, 4, 4),
        t5_layers=6, t5_heads=12, t5_d_kv=64, t5_d_ff=2240), resolution=128, num_frames=17)


def quick() -> WanBench:
    return WanBench("quick", {}, resolution=32, num_frames=5, lora_rank=4)


def prepare(workdir: Path, cfg: WanBench, n: int) -> tuple[Path, Path]:
    from difftune.testing import TinyWanSpec, write_example_video_dataset, write_tiny_wan

    repo = workdir / f"wan-{cfg.name}"
    reuse_or_write(repo, cfg.spec, lambda repo: write_tiny_wan(repo, "t2v", TinyWanSpec(**cfg.spec)))
    data = workdir / f"clips-{cfg.resolution}-{cfg.num_frames}-{n}"
    metadata = data / "metadata.csv"
    if not metadata.is_file():
        write_example_video_dataset(data, n, cfg.num_frames, (cfg.resolution, cfg.resolution))
    return repo, metadata


def flags(repo, metadata, cfg, task, output, *, dataset=None, repeat=1, components=COMPONENTS) -> list:
    from difftune.testing import tiny_wan_paths

    fresh(output)
    paths = tiny_wan_paths(repo)
    res = str(cfg.resolution)
    out = ["--task", task, "--output_path", str(output), "--model_paths", json.dumps([paths[c][0] for c in components]),
           "--tokenizer_path", str(repo / "tokenizer"), "--height", res, "--width", res,
           "--num_frames", str(cfg.num_frames), "--torch_dtype", "float32", "--learning_rate", "1e-4",
           "--num_epochs", "1", "--dataset_repeat", str(repeat), "--lora_base_model", "dit",
           "--lora_target_modules", "q,k,v,o,ffn.0,ffn.2", "--lora_rank", str(cfg.lora_rank), "--seed", "0",
           "--no_progress", "--enable_tensorboard_log", "false"]
    if dataset is None:
        return out + ["--dataset_base_path", str(metadata.parent), "--dataset_metadata_path", str(metadata)]
    return out + ["--dataset_base_path", str(dataset)]


def encode_times(repo: Path, cfg: WanBench, threads: int, repeats: int = 3) -> dict:
    """Median seconds of one VAE encode of a clip and one UMT5 encode of a 512-token prompt, fp32, no grad —
    the stage-1 work a one-stage step repeats."""
    import torch
    from diffusers import AutoencoderKLWan
    from transformers import AutoTokenizer, UMT5EncoderModel

    torch.set_num_threads(threads)
    vae = AutoencoderKLWan.from_pretrained(repo / "vae").eval()
    t5 = UMT5EncoderModel.from_pretrained(repo / "text_encoder").eval()
    tok = AutoTokenizer.from_pretrained(repo / "tokenizer")
    clip = torch.rand(1, 3, cfg.num_frames, cfg.resolution, cfg.resolution) * 2 - 1
    ids = tok(["a red ball rolling across a blue background"], padding="max_length", max_length=512,
              truncation=True, return_tensors="pt")


    return {"vae_encode_s": median_seconds(lambda: vae.encode(clip).latent_dist.mode(), repeats),
            "umt5_encode_s": median_seconds(lambda: t5(ids.input_ids, attention_mask=ids.attention_mask), repeats)}


def main(argv=None) -> dict:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--clips", type=int, default=None)
    p.add_argument("--repeat", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None, help="step intervals left out of the step time")
    args = p.parse_args(argv)
    cfg = quick() if args.quick else proportional()
    n = args.clips or 2
    repeat = args.repeat or (2 if args.quick else 4)
    warmup = args.warmup if args.warmup is not None else (1 if args.quick else 2)
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
    # the reference's Wan2.1-T2V-1.3B.sh trains --num_epochs 5 --dataset_repeat 100
    figures = split_figures(one, s1, s2, warmup, ref_steps=n * 5 * 100, tag="5x100")
    t1 = figures["step_time_one_stage_s"]
    dit = params["transformer"]
    result = {
        "benchmark": "wan_split_vs_unsplit", "config": cfg.name, "resolution": cfg.resolution,
        "num_frames": cfg.num_frames, "clips": n, "repeat": repeat, "steps": one["steps"], "warmup_steps": warmup,
        "isolated_processes": isolated, "params": params, "params_over_dit": {k: v / dit for k, v in params.items()},
        "real_params_over_dit": {k: v / REAL["transformer"] for k, v in REAL.items()}, **figures,
        "vae_encode_s": enc["vae_encode_s"], "umt5_encode_s": enc["umt5_encode_s"],
        "vae_share_of_one_stage_step": ratio(enc["vae_encode_s"], t1),
        "umt5_share_of_one_stage_step": ratio(enc["umt5_encode_s"], t1),
        # what stage 2 no longer does, from the two runs' step times; and the VAE's part of it, from the apart timings
        "cached_share_of_one_stage_step": 1.0 - figures["step_time_stage2_s"] / t1,
        "vae_share_of_cached_work": ratio(enc["vae_encode_s"], enc["vae_encode_s"] + enc["umt5_encode_s"]),
        "machine": info,
    }
    update_doc(resolve_doc(args), "wan_split_vs_unsplit", render(result))
    print(f"Wan split / one stage: total time {result['total_time_ratio']:.3f} (projected to 5 epochs x repeat "
          f"100: {result['projected_total_time_ratio_5x100']:.3f}), step time {result['step_time_ratio']:.3f}, "
          f"stage-2 peak RSS {result['peak_rss_ratio']:.3f} ({result['peak_rss_above_baseline_ratio']:.3f} above "
          f"the baseline); VAE encode {result['vae_share_of_one_stage_step']:.2f} of a one-stage step",
          file=sys.stderr)
    emit(result)
    return result


def render(r: dict) -> str:
    p, q, real = r["params"], r["params_over_dit"], r["real_params_over_dit"]
    rows = split_rows(r, f"{r['clips']} clips", ref_repeat=100, tag="5x100")
    head = (f"Config `{r['config']}`, {r['num_frames']}-frame clips at {r['resolution']}x{r['resolution']}: DiT "
            f"{p['transformer'] / 1e6:.2f}M, UMT5 {p['text_encoder'] / 1e6:.2f}M ({q['text_encoder']:.2f}x the "
            f"DiT; Wan2.1-T2V-1.3B {real['text_encoder']:.2f}x), VAE {p['vae'] / 1e6:.3f}M ({q['vae']:.3f}x; real "
            f"{real['vae']:.3f}x); LoRA rank {32 if r['config'] != 'quick' else 4} on q,k,v,o,ffn.0,ffn.2; fp32; "
            f"UMT5 prompts padded to 512 tokens; stage 1 took {r['stage1_seconds']:.1f} s (model loading included), "
            f"peak RSS {r['peak_rss_stage1_mib']:.0f} MiB. The work stage 2 leaves out is "
            f"{100 * r['cached_share_of_one_stage_step']:.0f}% of a one-stage step (1 - the step-time ratio). "
            f"Timed apart in the benchmark's own process afterwards, one VAE encode of a clip takes "
            f"{r['vae_encode_s']:.3f} s ({100 * r['vae_share_of_one_stage_step']:.0f}% of a one-stage step) and one "
            f"UMT5 encode {r['umt5_encode_s']:.3f} s ({100 * r['umt5_share_of_one_stage_step']:.0f}%): the VAE is "
            f"{100 * r['vae_share_of_cached_work']:.0f}% of the cached work (these apart timings and the runs' "
            f"steps were taken at different moments of a loaded machine, so their shares need not add up).")
    return "\n\n".join([head, table(["metric", "one stage", "split (stage 2)", "split ÷ one stage"], rows),
                        machine_line(r["machine"])])


if __name__ == "__main__":
    main()
