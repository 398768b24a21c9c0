"""Regenerate the tiny pretrained Qwen-Image bundled with difftune (`src/difftune/assets/tiny-qwen-image`).

Recipe (docs/demo.md has the numbers of the committed run):
1. A random tiny Qwen-Image in the official layout (`write_tiny_qwen_image` of families/qwen_image/tiny.py, `SPEC`):
   the text encoder (Qwen2.5-VL architecture) and the tokenizer stay as initialised; the DiT learns to read
   the random encoder's embeddings.
2. The VAE is trained on flat shapes (`scripts/train_tiny_vae.py`); its latent mean/std go into its config.
3. A captioned data set: coloured circles, squares and triangles on coloured backgrounds at 64x64
   ("a red circle on a blue background"; a tenth of the rows with an empty prompt, for classifier-free
   guidance), written in the reference's layout (images + metadata.csv).
4. The DiT is trained fully with difftune's own train command: `--task sft:split --trainable_models dit`
   (stage 1 caches latents and prompt embeddings, stage 2 trains the DiT from the cache).
5. The repository is assembled in the official layout with bf16 weights (as the official one) and a
   sample grid is rendered through `QwenImagePipeline.from_pretrained`.

Deterministic: every random draw is seeded and torch runs on a fixed number of threads (--threads), so a
re-run on the same machine and library versions gives the same files.

    .venv/bin/python scripts/make_base_model.py            # ~40 min on a 2-core CPU (one thread)
    .venv/bin/python scripts/make_base_model.py --vae DIR  # reuse a VAE trained by an earlier run
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(Path(__file__).resolve().parent))

from train_tiny_vae import reconstruction_error, set_latent_statistics, train_vae  # noqa: E402

from difftune.families.qwen_image.tiny import TinyQwenImageSpec, write_tiny_qwen_image  # noqa: E402

SPEC = TinyQwenImageSpec(
    num_layers=4, num_attention_heads=4, attention_head_dim=32, axes_dims_rope=(8, 12, 12),
    text_hidden=64, text_layers=2, text_heads=2, text_intermediate=128, mrope_section=(4, 6, 6),
    vae_base_dim=16, vae_dim_mult=(1, 2, 2, 2), vae_num_res_blocks=1, seed=0,
)
SAMPLE_PROMPTS = [
    "a red circle on a blue background", "a yellow square on a black background",
    "a white triangle on a green background", "a blue circle on a yellow background",
    "a black square on a white background", "a green triangle on a red background",
]


def write_shapes_dataset(root: Path, n: int, seed: int, empty_fraction: float = 0.1) -> Path:
    from difftune.io import atomic_save_image, atomic_write_text
    from difftune.shapes import random_spec, render

    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"difftune-base-{seed}")
    lines = ["image,prompt"]
    for i in range(n):
        spec = random_spec(rng)
        name = f"shape_{i:05d}.png"
        atomic_save_image(render(spec), root / name)
        prompt = "" if rng.random() < empty_fraction else spec.prompt
        lines.append(f'{name},"{prompt}"')
    metadata = root / "metadata.csv"
    atomic_write_text(metadata, "\n".join(lines) + "\n")
    return metadata


def train_dit(init: Path, metadata: Path, out: Path, steps: int, batch_size: int, lr: float, seed: int,
              images: int) -> dict:
    """Full DiT training through the train command (`sft:split`): returns its summary."""
    from difftune.demo import _train, model_files

    files = model_files(init)
    per_epoch = images // batch_size
    return _train([
        "--task", "sft:split", "--dataset_base_path", str(metadata.parent), "--dataset_metadata_path",
        str(metadata), "--model_paths", json.dumps([files["transformer"], files["text_encoder"], files["vae"]]),
        "--trainable_models", "dit", "--torch_dtype", "float32", "--height", "64", "--width", "64",
        "--batch_size", str(batch_size), "--learning_rate", str(lr), "--lr_scheduler", "cosine",
        "--lr_warmup_steps", str(min(200, steps // 10)), "--max_grad_norm", "1.0", "--max_steps", str(steps),
        "--num_epochs", "1", "--dataset_repeat", str(-(-steps // per_epoch)), "--seed", str(seed),
        "--output_path", str(out), "--enable_tensorboard_log", "false", "--data_process_batch_size", "64",
    ])


def assemble(init: Path, dit_weights: str, output: Path, dtype=torch.bfloat16) -> None:
    """The official layout, every component saved in `dtype`, written beside `output` and swapped in."""
    from diffusers import AutoencoderKLQwenImage, QwenImageTransformer2DModel
    from safetensors.torch import load_file
    from transformers import Qwen2_5_VLForConditionalGeneration

    staging = output.with_name(f".{output.name}.staging")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    for name in ("tokenizer", "scheduler"):
        shutil.copytree(init / name, staging / name)
    for name in ("model_index.json", "difftune_tiny_spec.json"):
        shutil.copy(init / name, staging / name)
    dit = QwenImageTransformer2DModel.from_pretrained(init / "transformer")
    missing, unexpected = dit.load_state_dict(load_file(dit_weights), strict=True)
    dit.to(dtype).save_pretrained(staging / "transformer")
    AutoencoderKLQwenImage.from_pretrained(init / "vae").to(dtype).save_pretrained(staging / "vae")
    Qwen2_5_VLForConditionalGeneration.from_pretrained(init / "text_encoder").to(dtype).save_pretrained(
        staging / "text_encoder")
    for config in staging.glob("*/config.json"):  # no scratch paths in the shipped files
        data = json.loads(config.read_text())
        data.pop("_name_or_path", None)
        config.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n")
    if output.exists():
        shutil.rmtree(output)
    staging.rename(output)


def sample_grid(model_dir: Path, path: Path, seeds=(0, 1, 2), steps: int = 20, cfg_scale: float = 3.0) -> float:
    """Render SAMPLE_PROMPTS x seeds through the bundled-model code path; returns seconds per image."""
    from difftune.demo import draw_grid, load_pipeline

    pipe = load_pipeline(model_dir)
    started = time.perf_counter()
    rows = [(f"seed {s}", pipe(SAMPLE_PROMPTS, cfg_scale=cfg_scale, height=64, width=64, num_inference_steps=steps,
                              seed=s, progress=False)) for s in seeds]
    per_image = (time.perf_counter() - started) / (len(seeds) * len(SAMPLE_PROMPTS))
    draw_grid(rows, [p.replace(" on a ", "\non a ") for p in SAMPLE_PROMPTS], path)
    return per_image


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--output", default=str(ROOT / "src" / "difftune" / "assets" / "tiny-qwen-image"))
    p.add_argument("--work", default=None, help="Scratch folder (default: a temporary one, removed after).")
    p.add_argument("--samples", default=str(ROOT / "docs" / "images" / "base_model_samples.png"))
    p.add_argument("--vae_steps", type=int, default=1600)
    p.add_argument("--vae", default=None, help="An already trained VAE folder (step 2 of an earlier run, e.g. "
                                                "<work>/init/vae): skip training one.")
    p.add_argument("--dit_steps", type=int, default=6000)
    p.add_argument("--images", type=int, default=6000)
    p.add_argument("--batch_size", type=int, default=32)
    p.add_argument("--learning_rate", type=float, default=1e-3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch threads (fixed for reproducibility).")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="difftune-base-"))
    record: dict = {"spec": {k: list(v) if isinstance(v, tuple) else v for k, v in vars(SPEC).items()},
                    "args": vars(args)}
    started = time.perf_counter()

    init = write_tiny_qwen_image(work / "init", SPEC, shard=False)
    from diffusers import AutoencoderKLQwenImage

    if args.vae:
        vae = AutoencoderKLQwenImage.from_pretrained(args.vae)
        record["vae"] = {"from": str(args.vae), "pixel_error": reconstruction_error(vae)}
    else:
        vae = AutoencoderKLQwenImage.from_pretrained(init / "vae")
        t0 = time.perf_counter()
        record["vae"] = train_vae(vae, steps=args.vae_steps, seed=args.seed)
        set_latent_statistics(vae)
        record["vae"]["pixel_error"] = reconstruction_error(vae)
        record["vae"]["total_seconds"] = round(time.perf_counter() - t0, 1)
    vae.save_pretrained(init / "vae")
    print(f"vae: {json.dumps(record['vae'])}", flush=True)

    t0 = time.perf_counter()
    metadata = write_shapes_dataset(work / "data", args.images, args.seed)
    record["data_seconds"] = round(time.perf_counter() - t0, 1)
    t0 = time.perf_counter()
    summary = train_dit(init, metadata, work / "dit", args.dit_steps, args.batch_size, args.learning_rate,
                        args.seed, args.images)
    losses = summary["losses"]
    record["dit"] = {"steps": summary["steps"], "seconds": round(time.perf_counter() - t0, 1),
                     "stage2_seconds": round(summary["seconds"], 1),
                     "loss_first_100": sum(losses[:100]) / len(losses[:100]),
                     "loss_last_100": sum(losses[-100:]) / len(losses[-100:])}
    print(f"dit: {json.dumps(record['dit'])}", flush=True)

    output = Path(args.output)
    assemble(init, summary["saved"][-1], output)
    record["training_seconds"] = round(time.perf_counter() - started, 1)
    sizes = {str(f.relative_to(output)): f.stat().st_size for f in sorted(output.rglob("*")) if f.is_file()}
    record["size_bytes"] = sum(sizes.values())
    samples = Path(args.samples)
    samples.parent.mkdir(parents=True, exist_ok=True)
    record["seconds_per_image_20_steps"] = round(sample_grid(output, samples), 3)
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(record, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
