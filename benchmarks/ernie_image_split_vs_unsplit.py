"""ERNIE-Image: split training against one-stage training on the same model, data and flags.

The ERNIE-Image family at CPU scale with PaddlePaddle/ERNIE-Image's proportions (the Ministral-3 3B language model,
the part of the text encoder that is loaded, 0.43x the 8B DiT's parameters; the FLUX.2 AE about 0.01x), three runs
of the CLI path, one process each: `sft` (one stage), `sft:data_process` (stage 1: Ministral-3, the AE) and
`sft:train` (stage 2: the DiT alone, from the cache). Also times, in this process, one Ministral-3 encode of a
prompt (its own tokens, unpadded, as diffusers and the reference encode it) and one AE encode of an image, to give
their share of a one-stage step. Prints one JSON line (the ratios side by side); writes its table to
docs/benchmarks.md.

    .venv/bin/python benchmarks/ernie_image_split_vs_unsplit.py            # the proportional model
    .venv/bin/python benchmarks/ernie_image_split_vs_unsplit.py --quick    # smoke run on the tests' tiny model
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
# PaddlePaddle/ERNIE-Image: the DiT (hidden 4096, 36 layers, MLP 12288), Ministral-3 3B's language model (26
# layers of 3072, its 131072-token embedding tied; the vision tower is not loaded), the FLUX.2 AE
REAL = {"transformer": 7.97e9, "text_encoder": 3.43e9, "vae": 0.084e9}


@dataclass
class ErnieImageBench:
    name: str
    spec: dict  # TinyErnieImageSpec fields
    resolution: int
    lora_rank: int = 32


def proportional() -> ErnieImageBench:
    """Heads of 128 and RoPE axes (32, 48, 48) as ERNIE-Image's DiT (2 heads and 4 layers against 32 and 36, the
    MLP at 3x the width as there), Ministral-3 with heads of 128, one KV head per two and its MLP at 3.25x the width
    (a little above 9216 / 3072, for the embedding the byte vocabulary lacks) to reach 0.42x the DiT, the AE at
    about FLUX.2's 0.01x; 256x256 gives 256 image tokens."""
    return ErnieImageBench("proportional", dict(
        hidden=256, heads=2, layers=4, ffn=768, text_hidden=256, text_layers=2, text_heads=2, text_head_dim=128,
        text_intermediate=832, vae_width=10), resolution=256)


def quick() -> ErnieImageBench:
    return ErnieImageBench("quick", {}, resolution=64, lora_rank=4)


def prepare(workdir: Path, cfg: ErnieImageBench, n: int) -> tuple[Path, Path]:
    from support.ernie_image import TinyErnieImageSpec, write_tiny_ernie_image

    repo = workdir / f"ernie-image-{cfg.name}"
    reuse_or_write(repo, cfg.spec,
                   lambda repo: write_tiny_ernie_image(repo, TinyErnieImageSpec(**cfg.spec), shard=False))
    metadata = workdir / f"data-{cfg.resolution}-{n}" / "metadata.csv"
    if not metadata.is_file():
        write_images(metadata.parent, n, cfg.resolution)
    return repo, metadata


def flags(repo, metadata, cfg, task, output, *, dataset=None, repeat=1, components=COMPONENTS) -> list:
    from difftune.families.ernie_image.components import LORA_TARGET_MODULES

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


def encode_times(repo: Path, cfg: ErnieImageBench, threads: int, repeats: int = 3) -> dict:
    """Median seconds of one Ministral-3 encode of a prompt (second-to-last hidden states) and one AE encode of an
    image, fp32, no grad: the stage-1 work a one-stage step repeats."""
    import torch
    from diffusers import AutoencoderKLFlux2
    from transformers import AutoTokenizer

    from difftune.families.ernie_image.pipeline import ErnieImagePipeline
    from difftune.models import ModelConfig

    torch.set_num_threads(threads)
    vae = AutoencoderKLFlux2.from_pretrained(repo / "vae").eval()
    pipe = ErnieImagePipeline.from_pretrained(torch_dtype=torch.float32, model_configs=[
        ModelConfig(str(repo / "text_encoder" / "model.safetensors"))], tokenizer_config=ModelConfig(str(repo / "tokenizer")))
    ids = torch.tensor([AutoTokenizer.from_pretrained(repo / "tokenizer")(PROMPTS[0])["input_ids"]])
    image = torch.rand(1, 3, cfg.resolution, cfg.resolution) * 2 - 1
    with torch.no_grad():
        return {"vae_encode_s": median_seconds(lambda: vae.encode(image).latent_dist.mode(), repeats),
                "text_encode_s": median_seconds(lambda: pipe.text_encoder(input_ids=ids, output_hidden_states=True),
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
        params = param_counts(repo, {c: f"{c}/*.safetensors" for c in COMPONENTS})
        one = run_difftune(flags(repo, metadata, cfg, "sft", wd / "one", repeat=repeat), isolated, args.threads)
        s1 = run_difftune(flags(repo, metadata, cfg, "sft:data_process", wd / "cache",
                                components=("text_encoder", "vae")), isolated, args.threads)
        s2 = run_difftune(flags(repo, metadata, cfg, "sft:train", wd / "two", dataset=wd / "cache", repeat=repeat,
                                components=("transformer",)), isolated, args.threads)
        enc = encode_times(repo, cfg, args.threads)
    # the reference's lora/ERNIE-Image.sh trains --num_epochs 5 --dataset_repeat 50
    figures = split_figures(one, s1, s2, warmup, ref_steps=n * 5 * 50, tag="5x50")
    t1, dit = figures["step_time_one_stage_s"], params["transformer"]
    result = {
        "benchmark": "ernie_image_split_vs_unsplit", "config": cfg.name, "resolution": cfg.resolution, "images": n,
        "repeat": repeat, "steps": one["steps"], "warmup_steps": warmup, "isolated_processes": isolated,
        "params": params, "params_over_dit": {k: v / dit for k, v in params.items()},
        "real_params_over_dit": {k: v / REAL["transformer"] for k, v in REAL.items()}, **figures,
        "text_encode_s": enc["text_encode_s"], "vae_encode_s": enc["vae_encode_s"],
        "text_share_of_one_stage_step": ratio(enc["text_encode_s"], t1),
        "vae_share_of_one_stage_step": ratio(enc["vae_encode_s"], t1),
        "cached_share_of_one_stage_step": 1.0 - figures["step_time_stage2_s"] / t1,
        "machine": info,
    }
    update_doc(resolve_doc(args), "ernie_image_split_vs_unsplit", render(result))
    print(f"ERNIE-Image split / one stage: total time {result['total_time_ratio']:.3f} (projected to 5 epochs x "
          f"repeat 50: {result['projected_total_time_ratio_5x50']:.3f}), step time {result['step_time_ratio']:.3f}, "
          f"stage-2 peak RSS {result['peak_rss_ratio']:.3f}; Ministral-3 encode "
          f"{result['text_share_of_one_stage_step']:.2f} of a one-stage step", file=sys.stderr)
    emit(result)
    return result


def render(r: dict) -> str:
    p, q, real = r["params"], r["params_over_dit"], r["real_params_over_dit"]
    rows = split_rows(r, f"{r['images']} images", ref_repeat=50, tag="5x50")
    head = (f"Config `{r['config']}` at {r['resolution']}x{r['resolution']}: DiT {p['transformer'] / 1e6:.2f}M, "
            f"text encoder file {p['text_encoder'] / 1e6:.2f}M ({q['text_encoder']:.3f}x the DiT, its small vision "
            f"tower included; ERNIE-Image's loaded language model {real['text_encoder']:.3f}x), AE "
            f"{p['vae'] / 1e6:.3f}M ({q['vae']:.4f}x; real {real['vae']:.4f}x); LoRA rank "
            f"{32 if r['config'] != 'quick' else 4} on to_q,to_k,to_v,to_out.0; fp32; stage 1 took "
            f"{r['stage1_seconds']:.1f} s (model loading included), peak RSS {r['peak_rss_stage1_mib']:.0f} MiB. The "
            f"work stage 2 leaves out is {100 * r['cached_share_of_one_stage_step']:.0f}% of a one-stage step (1 - the "
            f"step-time ratio). Timed apart afterwards, one Ministral-3 encode of a prompt takes "
            f"{r['text_encode_s']:.3f} s ({100 * r['text_share_of_one_stage_step']:.0f}% of a one-stage step) and one "
            f"AE encode of an image {r['vae_encode_s']:.3f} s ({100 * r['vae_share_of_one_stage_step']:.0f}%).")
    return "\n\n".join([head, table(["metric", "one stage", "split (stage 2)", "split ÷ one stage"], rows),
                        machine_line(r["machine"])])


if __name__ == "__main__":
    main()
