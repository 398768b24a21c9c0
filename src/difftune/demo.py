"""`difftune demo`: a two-stage split LoRA fine-tune, end to end, on a CPU, in about a minute.

It writes a tiny Qwen-Image in the official layout and a small fine-tuning set of one concept (a trigger
word with a white square on magenta), runs stage 1 (`sft:data_process`, text encoder + VAE) and stage 2
(`sft:train`, the DiT alone) through the same code as a real run, and writes into the output folder: the
LoRA, the cache, `loss.png`, `samples.png` (the same prompts and seeds before | after), `summary.json`.

The model is randomly initialised (a pretrained tiny base model is not bundled yet), so the decoded
pictures are not meaningful to the eye; the learning is measured where it is meaningful: how close the
generated latents for the trigger prompt are to the concept's latents, before and after training.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import time
from pathlib import Path

import torch

CONCEPT_PROMPT = "a zqx square"
TARGETS = "to_q,to_k,to_v,add_q_proj,add_k_proj,add_v_proj,to_out.0,to_add_out,img_mlp.net.2,img_mod.1,txt_mlp.net.2,txt_mod.1"


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def write_concept_dataset(root: Path, n: int = 4) -> Path:
    from PIL import Image, ImageDraw

    root.mkdir(parents=True, exist_ok=True)
    lines = ["image,prompt"]
    for i in range(n):
        img = Image.new("RGB", (64, 64), (200, 30, 200))
        o = 8 + 4 * i
        ImageDraw.Draw(img).rectangle((o, o, o + 28, o + 28), fill=(255, 255, 255))
        img.save(root / f"image_{i + 1}.png")
        lines.append(f"image_{i + 1}.png,{CONCEPT_PROMPT}")
    (root / "metadata.csv").write_text("\n".join(lines) + "\n")
    return root / "metadata.csv"


def plot_losses(losses: list[float], path: Path) -> None:
    from PIL import Image, ImageDraw

    w, h, pad = 480, 240, 30
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    d.rectangle((pad, pad, w - pad, h - pad), outline=(120, 120, 120))
    if losses:
        smooth, ema = [], None
        for v in losses:
            ema = v if ema is None else 0.9 * ema + 0.1 * v
            smooth.append(ema)
        lo, hi = min(losses), max(losses)
        span = (hi - lo) or 1.0

        def pt(i, v):
            return pad + (w - 2 * pad) * i / max(1, len(losses) - 1), h - pad - (h - 2 * pad) * (v - lo) / span

        d.line([pt(i, v) for i, v in enumerate(losses)], fill=(180, 180, 230))
        d.line([pt(i, v) for i, v in enumerate(smooth)], fill=(20, 20, 160), width=2)
        d.text((pad, 8), f"training loss (stage 2), {len(losses)} steps: {smooth[0]:.3f} -> {smooth[-1]:.3f}",
               fill="black")
    img.save(path)


def latent_distance(pipe, prompts, seeds, concept_latents, steps: int) -> tuple[float, list]:
    """Mean distance of generated latents to the nearest concept latent, and the decoded images."""
    from .pipelines.images import tensor_to_images
    from .pipelines.qwen_image import vae_decode

    dists, images = [], []
    for prompt, seed in zip(prompts, seeds):
        latents = pipe(prompt, cfg_scale=1.0, height=64, width=64, num_inference_steps=steps, seed=seed,
                       progress=False, output_type="latent")
        d = ((concept_latents - latents.float()) ** 2).flatten(1).mean(1).min().item()
        dists.append(d)
        images.extend(tensor_to_images(vae_decode(pipe, latents)))
    return sum(dists) / len(dists), images


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="difftune demo", description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="demo_out")
    parser.add_argument("--steps", type=int, default=200, help="Optimizer steps of stage 2.")
    parser.add_argument("--sample_steps", type=int, default=10)
    args = parser.parse_args(argv)

    from .cli.args import training_parser
    from .models import ModelConfig
    from .pipelines.qwen_image import QwenImagePipeline, vae_encode
    from .pipelines.images import images_to_tensor
    from .testing import tiny_qwen_image_paths, write_tiny_qwen_image
    from .training.run import run
    from .training.validation import make_grid

    out = Path(args.output)
    out.mkdir(parents=True, exist_ok=True)
    repo = write_tiny_qwen_image(out / "base_model")
    meta = write_concept_dataset(out / "data")
    paths = tiny_qwen_image_paths(repo)
    models = json.dumps([paths["transformer"], paths["text_encoder"], paths["vae"][0]])

    def load_pipe():
        return QwenImagePipeline.from_pretrained(
            torch_dtype=torch.float32,
            model_configs=[ModelConfig(paths["transformer"]), ModelConfig(paths["text_encoder"]),
                           ModelConfig(paths["vae"][0])], tokenizer_config=ModelConfig(str(repo / "tokenizer")))

    pipe = load_pipe()
    from PIL import Image

    concept = [Image.open(p).convert("RGB") for p in sorted((out / "data").glob("image_*.png"))]
    with torch.no_grad():
        concept_latents = vae_encode(pipe, images_to_tensor(concept)).float()
    prompts, seeds = [CONCEPT_PROMPT] * 4, [0, 1, 2, 3]
    before, before_images = latent_distance(pipe, prompts, seeds, concept_latents, args.sample_steps)
    del pipe

    common = ["--max_pixels", "4096", "--model_paths", models, "--lora_base_model", "dit", "--lora_target_modules",
              TARGETS, "--lora_rank", "8", "--learning_rate", "2e-3", "--torch_dtype", "float32", "--seed", "0"]
    print("stage 1: encoding the fine-tuning set once (text encoder + VAE)")
    t0, rss0 = time.perf_counter(), _peak_rss_mb()
    run(training_parser().parse_args(["--task", "sft:data_process", "--dataset_base_path", str(meta.parent),
                                      "--dataset_metadata_path", str(meta), "--output_path", str(out / "cache"),
                                      *common]))
    stage1_s, stage1_rss = time.perf_counter() - t0, _peak_rss_mb()
    print("stage 2: training the LoRA on the DiT from the cache")
    repeat = max(1, -(-args.steps // 4))
    t0 = time.perf_counter()
    summary = run(training_parser().parse_args(
        ["--task", "sft:train", "--dataset_base_path", str(out / "cache"), "--output_path", str(out / "lora"),
         "--dataset_repeat", str(repeat), "--max_steps", str(args.steps), *common]))
    stage2_s, stage2_rss = time.perf_counter() - t0, _peak_rss_mb()
    lora = Path(summary["saved"][-1])

    pipe = load_pipe()
    pipe.load_lora(pipe.dit, str(lora))
    after, after_images = latent_distance(pipe, prompts, seeds, concept_latents, args.sample_steps)
    grid = make_grid(before_images + after_images, columns=len(prompts))
    grid.save(out / "samples.png")
    plot_losses(summary["losses"], out / "loss.png")
    result = {
        "steps": summary["steps"], "stage1_seconds": round(stage1_s, 2), "stage2_seconds": round(stage2_s, 2),
        "stage1_peak_rss_mb": round(stage1_rss, 1), "stage2_peak_rss_mb": round(stage2_rss, 1),
        "latent_distance_before": round(before, 4), "latent_distance_after": round(after, 4),
        "closer_by": round(1 - after / before, 4), "lora": str(lora), "cache": str(out / "cache"),
        "note": "closer_by = 1 - after/before: the share by which generated latents for the trigger prompt moved "
                "towards the concept images' latents (mean squared distance to the nearest one). The base model is "
                "random, so decoded pictures are not meaningful to the eye. Peak RSS is the process's high-water "
                "mark after each stage (stage 2 includes stage 1's peak).",
    }
    tmp = out / ".summary.json.tmp"
    tmp.write_text(json.dumps(result, indent=2))
    os.replace(tmp, out / "summary.json")
    print(json.dumps(result, indent=2))
    return 0
