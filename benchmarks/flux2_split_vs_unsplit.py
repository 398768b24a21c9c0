"""FLUX.2: split training against one-stage training on the same model, data and flags.

The FLUX.2 family at CPU scale with FLUX.2-klein-4B's proportions (its Qwen3-4B text encoder about 0.93x the 3.9B
DiT's parameters, the FLUX.2 autoencoder 0.02x), three runs of the CLI path, one process each: `sft` (one stage),
`sft:data_process` (stage 1: Qwen3, the autoencoder) and `sft:train` (stage 2: the DiT alone, from the cache). Also
times, in this process, one Qwen3 encode of a prompt (padded to 512 tokens, hidden states 9, 18, 27, as diffusers and
the reference encode it) and one autoencoder encode of an image, to give their share of a one-stage step. Prints one
JSON line; writes its table to docs/benchmarks.md.

    .venv/bin/python benchmarks/flux2_split_vs_unsplit.py            # the proportional model (minutes here)
    .venv/bin/python benchmarks/flux2_split_vs_unsplit.py --quick    # smoke run on the tests' tiny model
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
# FLUX.2-klein-4B: the DiT (5 + 20 blocks, 3072 wide), Qwen3-4B loaded without its LM head, the FLUX.2 autoencoder
REAL = {"transformer": 3.88e9, "text_encoder": 3.6e9, "vae": 0.084e9}


@dataclass
class Flux2Bench:
    name: str
    spec: dict  # TinyFlux2Spec fields
    resolution: int
    lora_rank: int = 32


def proportional() -> Flux2Bench:
    """klein-4B's depths (5 double, 20 single blocks) at 2 heads of 128 (its 24), Qwen3 at 27 layers (the deepest
    it reads) 256 wide with a 4x MLP to reach about the DiT's size, the autoencoder at 32 channels (about 0.02x);
    256x256 gives 256 image tokens beside the prompt's 512."""
    return Flux2Bench("proportional", dict(heads=2, head_dim=128, text_hidden=256, text_intermediate=1024,
                                           vae_channels=32), resolution=256)


def quick() -> Flux2Bench:
    return Flux2Bench("quick", {}, resolution=64, lora_rank=4)


def prepare(workdir: Path, cfg: Flux2Bench, n: int) -> tuple[Path, Path]:
    from support.flux2 import TinyFlux2Spec, write_tiny_klein

    repo = workdir / f"flux2-klein-{cfg.name}"
    reuse_or_write(repo, cfg.spec, lambda repo: write_tiny_klein(repo, "4B", TinyFlux2Spec(**cfg.spec), shard=False))
    metadata = workdir / f"data-{cfg.resolution}-{n}" / "metadata.csv"
    if not metadata.is_file():
        write_images(metadata.parent, n, cfg.resolution)
    return repo, metadata


def flags(repo, metadata, cfg, task, output, *, dataset=None, repeat=1, components=COMPONENTS) -> list:
    from difftune.families.flux2.components import LORA_TARGET_MODULES

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


def encode_times(repo: Path, cfg: Flux2Bench, threads: int, repeats: int = 3) -> dict:
    """Median seconds of one Qwen3 encode of a prompt and one autoencoder encode of an image, fp32, no grad: the
    stage-1 work a one-stage step repeats."""
    import torch
    from diffusers import AutoencoderKLFlux2
    from transformers import AutoTokenizer, Qwen3Model

    torch.set_num_threads(threads)
    vae = AutoencoderKLFlux2.from_pretrained(repo / "vae").eval()
    qwen = Qwen3Model.from_pretrained(repo / "text_encoder").eval()
    tok = AutoTokenizer.from_pretrained(repo / "tokenizer")
    image = torch.rand(1, 3, cfg.resolution, cfg.resolution) * 2 - 1
    text = tok.apply_chat_template([{"role": "user", "content": PROMPTS[0]}], tokenize=False,
                                   add_generation_prompt=True, enable_thinking=False)
    ids = tok([text], padding="max_length", max_length=512, truncation=True, return_tensors="pt")
    with torch.no_grad():
        return {"vae_encode_s": median_seconds(lambda: vae.encode(image).latent_dist.mode(), repeats),
                "qwen3_encode_s": median_seconds(lambda: qwen(ids.input_ids, attention_mask=ids.attention_mask,
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
    # the reference's lora/FLUX.2-klein-4B.sh trains --num_epochs 5 --dataset_repeat 50
    figures = split_figures(one, s1, s2, warmup, ref_steps=n * 5 * 50, tag="5x50")
    t1, dit = figures["step_time_one_stage_s"], params["transformer"]
    result = {
        "benchmark": "flux2_split_vs_unsplit", "config": cfg.name, "resolution": cfg.resolution, "images": n,
        "repeat": repeat, "steps": one["steps"], "warmup_steps": warmup, "isolated_processes": isolated,
        "params": params, "params_over_dit": {k: v / dit for k, v in params.items()},
        "real_params_over_dit": {k: v / REAL["transformer"] for k, v in REAL.items()}, **figures,
        "qwen3_encode_s": enc["qwen3_encode_s"], "vae_encode_s": enc["vae_encode_s"],
        "qwen3_share_of_one_stage_step": ratio(enc["qwen3_encode_s"], t1),
        "vae_share_of_one_stage_step": ratio(enc["vae_encode_s"], t1),
        "cached_share_of_one_stage_step": 1.0 - figures["step_time_stage2_s"] / t1,
        "machine": info,
    }
    update_doc(resolve_doc(args), "flux2_split_vs_unsplit", render(result))
    print(f"FLUX.2 split / one stage: total time {result['total_time_ratio']:.3f} (projected to 5 epochs x repeat "
          f"50: {result['projected_total_time_ratio_5x50']:.3f}), step time {result['step_time_ratio']:.3f}, "
          f"stage-2 peak RSS {result['peak_rss_ratio']:.3f}; Qwen3 encode "
          f"{result['qwen3_share_of_one_stage_step']:.2f} of a one-stage step", file=sys.stderr)
    emit(result)
    return result


def render(r: dict) -> str:
    p, q, real = r["params"], r["params_over_dit"], r["real_params_over_dit"]
    rows = split_rows(r, f"{r['images']} images", ref_repeat=50, tag="5x50")
    head = (f"Config `{r['config']}` at {r['resolution']}x{r['resolution']}: DiT {p['transformer'] / 1e6:.2f}M, "
            f"Qwen3 {p['text_encoder'] / 1e6:.2f}M ({q['text_encoder']:.3f}x the DiT; FLUX.2-klein-4B "
            f"{real['text_encoder']:.3f}x), autoencoder {p['vae'] / 1e6:.3f}M ({q['vae']:.4f}x; real "
            f"{real['vae']:.4f}x); LoRA rank {r.get('lora_rank', 32 if r['config'] != 'quick' else 4)} on the "
            f"reference's targets; fp32; prompts padded to 512 tokens; stage 1 took {r['stage1_seconds']:.1f} s "
            f"(model loading included), peak RSS {r['peak_rss_stage1_mib']:.0f} MiB. The work stage 2 leaves out is "
            f"{100 * r['cached_share_of_one_stage_step']:.0f}% of a one-stage step (1 - the step-time ratio). "
            f"Timed apart afterwards, one Qwen3 encode of a prompt takes {r['qwen3_encode_s']:.3f} s "
            f"({100 * r['qwen3_share_of_one_stage_step']:.0f}% of a one-stage step) and one autoencoder encode of an "
            f"image {r['vae_encode_s']:.3f} s ({100 * r['vae_share_of_one_stage_step']:.0f}%).")
    return "\n\n".join([head, table(["metric", "one stage", "split (stage 2)", "split ÷ one stage"], rows),
                        machine_line(r["machine"])])


if __name__ == "__main__":
    main()
