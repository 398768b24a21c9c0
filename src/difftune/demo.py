"""`difftune demo`: a two-stage split LoRA fine-tune of the bundled tiny Qwen-Image, on the CPU, in minutes.

The bundled base model (`assets/tiny-qwen-image`, made by `scripts/make_base_model.py`) draws circles,
squares and triangles in six colours on coloured backgrounds. The demo teaches it a shape it has never
seen, a five-pointed star, from a few procedurally drawn captioned images ("a red star on a blue
background"; "star" is the new word), with the real train command: stage 1 (`--task sft:data_process`)
encodes the images and prompts once into a cache, stage 2 (`--task sft:train`) trains a LoRA on the DiT
from that cache alone. It samples the same prompts and seeds before and after, and measures how star-like
the samples are (`difftune.shapes.aligned_iou`: the foreground region compared with a star of the same
position and area; a drawn star scores about 0.95, a circle about 0.67).

Writes into --output: data/ (the fine-tuning set), cache/ (stage 1), lora/ (stage 2: the LoRA, TensorBoard
logs), loss.png, samples.png (before / after / reference), summary.json.
"""

from __future__ import annotations

import argparse
import json
import math
import random
import resource
import time
from contextlib import contextmanager
from pathlib import Path

from .errors import UserError
from .io import atomic_save_image, atomic_write_text

# The demo (and the example workspace) are this family's: shared code names no family (tests/families/test_seam.py),
# and this spec name, looked up in the registry, is the one exception.
DEMO_FAMILY = "qwen_image"
# The bundled base model is named for its family: assets/tiny-qwen-image.
BUNDLED_MODEL = Path(__file__).resolve().parent / "assets" / f"tiny-{DEMO_FAMILY.replace('_', '-')}"
CONCEPT = "star"
# (foreground, background) of the evaluation prompts; the fine-tuning set draws its own random pairs.
EVAL_COLORS = (("red", "blue"), ("yellow", "black"), ("white", "green"), ("blue", "yellow"))
CONTROL_PROMPT = "a green circle on a white background"  # a shape the base model knows, for the grid


def demo_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="difftune demo", description=__doc__.split("\n")[0])
    p.add_argument("--output", default="demo_out", help="Folder for everything the demo writes (default demo_out).")
    p.add_argument("--steps", type=int, default=1000, help="LoRA training steps in stage 2.")
    p.add_argument("--images", type=int, default=60, help="Images in the fine-tuning set.")
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("--learning_rate", type=float, default=5e-3)
    p.add_argument("--lora_rank", type=int, default=16)
    p.add_argument("--sample_steps", type=int, default=20, help="Denoising steps per sample.")
    p.add_argument("--cfg_scale", type=float, default=3.0)
    p.add_argument("--seeds", type=int, default=2, help="Seeds per evaluation prompt.")
    p.add_argument("--seed", type=int, default=0, help="Seed of the fine-tuning set and of training.")
    p.add_argument("--model_dir", default=str(BUNDLED_MODEL), help="Base model in the official layout (default: the bundled one).")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice).")
    p.add_argument("--no_progress", action="store_true")
    return p


# -- peak memory per stage ------------------------------------------------------------------------------

def _vm_hwm_mib() -> float | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS counter of this process (Linux: write 5 to /proc/self/clear_refs)."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


@contextmanager
def measured(record: dict, name: str):
    """Wall time and peak RSS (MiB) of the block, into record[name]."""
    per_stage = _reset_peak()
    started = time.perf_counter()
    yield
    entry = {"seconds": round(time.perf_counter() - started, 2)}
    peak = _vm_hwm_mib() if per_stage else None
    if peak is None:  # no per-stage counter: the process's peak so far (ru_maxrss is KiB on Linux)
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        entry["peak_rss_scope"] = "process so far"
    entry["peak_rss_mib"] = round(peak, 1)
    record[name] = entry


# -- data, model, samples -------------------------------------------------------------------------------

def write_concept_dataset(root: Path, n: int, seed: int) -> Path:
    """n captioned star images + metadata.csv, the reference's layout. The colour pairs go round every
    (foreground, background) pair in turn, so the LoRA sees each colour word with the new shape; position
    and size are random."""
    from dataclasses import replace

    from .shapes import COLORS, random_spec, render

    root.mkdir(parents=True, exist_ok=True)
    rng = random.Random(f"difftune-demo-{seed}")
    pairs = [(c, b) for c in COLORS for b in COLORS if c != b]
    rng.shuffle(pairs)
    lines = ["image,prompt"]
    for i in range(n):
        color, background = pairs[i % len(pairs)]
        spec = replace(random_spec(rng, shapes=(CONCEPT,)), color=color, background=background)
        name = f"{CONCEPT}_{i:03d}.png"
        atomic_save_image(render(spec), root / name)
        lines.append(f'{name},"{spec.prompt}"')
    metadata = root / "metadata.csv"
    atomic_write_text(metadata, "\n".join(lines) + "\n")
    return metadata


def demo_family():
    """The demo family's spec, from the registry."""
    from .core.family import get_family

    return get_family(DEMO_FAMILY)


def model_files(model_dir: Path) -> dict[str, list[str]]:
    """The weight files of a repository in the official layout, per component."""
    files = {
        "transformer": sorted(str(p) for p in (model_dir / "transformer").glob("diffusion_pytorch_model*.safetensors")),
        "text_encoder": sorted(str(p) for p in (model_dir / "text_encoder").glob("model*.safetensors")),
        "vae": sorted(str(p) for p in (model_dir / "vae").glob("diffusion_pytorch_model*.safetensors")),
    }
    missing = [k for k, v in files.items() if not v] + ([] if (model_dir / "tokenizer").is_dir() else ["tokenizer"])
    if missing:
        raise UserError(f"--model_dir {model_dir}: no {', '.join(missing)} there (expected the official layout: "
                        f"transformer/, text_encoder/, vae/, tokenizer/)")
    return files


def load_pipeline(model_dir: Path, lora: str | None = None):
    """The base model through its family's `from_pretrained` (the path real weights take), fp32."""
    import torch

    from .models import ModelConfig

    files = model_files(model_dir)
    configs = [ModelConfig(path=files[c]) for c in ("transformer", "text_encoder", "vae")]
    pipe = demo_family().pipeline.from_pretrained(torch_dtype=torch.float32, device="cpu", model_configs=configs,
                                                  tokenizer_config=ModelConfig(path=str(model_dir / "tokenizer")))
    if lora:
        pipe.load_lora(pipe.dit, lora)
    return pipe


def eval_prompts() -> list[tuple[str, str, str]]:
    return [(f"a {c} {CONCEPT} on a {b} background", c, b) for c, b in EVAL_COLORS]


def render_samples(pipe, prompts: list[str], seeds: list[int], steps: int, cfg_scale: float, desc: str,
                   progress: bool) -> list[list]:
    """samples[seed_index][prompt_index]: one batch of all prompts per seed (the same noise before/after)."""
    from tqdm.auto import tqdm

    out = []
    for seed in tqdm(seeds, desc=desc, disable=not progress, dynamic_ncols=True):
        out.append(pipe(prompts, cfg_scale=cfg_scale, height=64, width=64, num_inference_steps=steps, seed=seed,
                        progress=False))
    return out


def concept_scores(samples: list[list], colors: list[tuple[str, str]]) -> dict:
    """Mean star IoU (aligned: position and size factored out) and the fraction classified as a star."""
    from .shapes import aligned_iou, classify_shape, foreground_mask

    ious, stars, per_image = [], 0, []
    for row in samples:
        for image, (fg, bg) in zip(row, colors):
            mask = foreground_mask(image, fg, bg)
            iou = aligned_iou(mask, CONCEPT)
            shape = classify_shape(mask)
            ious.append(iou)
            stars += shape == CONCEPT
            per_image.append({"star_iou": round(iou, 4), "looks_like": shape})
    return {"star_iou": round(sum(ious) / len(ious), 4), "star_fraction": round(stars / len(ious), 4),
            "per_image": per_image}


# -- pictures (PIL only) --------------------------------------------------------------------------------

def draw_loss_curve(losses: list[float], path: Path, title: str = "stage 2: LoRA training loss") -> None:
    from PIL import Image, ImageDraw

    w, h, left, right, top, bottom = 640, 360, 60, 20, 30, 40
    img = Image.new("RGB", (w, h), "white")
    d = ImageDraw.Draw(img)
    d.text((left, 8), title, fill="black")
    if losses:
        lo, hi = min(losses), max(losses)
        hi = hi if hi > lo else lo + 1e-6
        n = len(losses)

        def xy(i, v):
            return (left + (w - left - right) * (i / max(1, n - 1)),
                    top + (h - top - bottom) * (1 - (v - lo) / (hi - lo)))

        ema, smooth = None, []
        for v in losses:
            ema = v if ema is None else 0.9 * ema + 0.1 * v
            smooth.append(ema)
        d.line([xy(i, v) for i, v in enumerate(losses)], fill=(170, 190, 230), width=1)
        d.line([xy(i, v) for i, v in enumerate(smooth)], fill=(20, 60, 170), width=2)
        for frac in (0.0, 0.5, 1.0):
            v = lo + frac * (hi - lo)
            y = xy(0, v)[1]
            d.line([(left - 4, y), (left, y)], fill="black")
            d.text((4, y - 6), f"{v:.3f}", fill="black")
        for i in sorted({0, n // 2, n - 1}):
            x = xy(i, lo)[0]
            d.text((x - 8, h - bottom + 8), str(i + 1), fill="black")
        d.text((w - right - 190, top), "light: per step, dark: moving average", fill=(90, 90, 90))
    d.rectangle((left, top, w - right, h - bottom), outline="black")
    d.text((w // 2 - 20, h - 16), "step", fill="black")
    atomic_save_image(img, path)


def draw_grid(rows: list[tuple[str, list]], columns: list[str], path: Path, scale: int = 2) -> None:
    """A labelled grid: one row per (label, images), one column per caption."""
    from PIL import Image, ImageDraw

    cell = 64 * scale
    label_w, head_h, pad = 70, 30, 4
    ncol = len(columns)
    img = Image.new("RGB", (label_w + ncol * (cell + pad), head_h + len(rows) * (cell + pad)), "white")
    d = ImageDraw.Draw(img)
    for j, caption in enumerate(columns):
        x = label_w + j * (cell + pad)
        for k, line in enumerate(caption.split("\n")[:2]):
            d.text((x + 2, 2 + 12 * k), line, fill="black")
    for i, (label, images) in enumerate(rows):
        y = head_h + i * (cell + pad)
        d.text((4, y + cell // 2 - 6), label, fill="black")
        for j, image in enumerate(images):
            img.paste(image.resize((cell, cell), Image.NEAREST), (label_w + j * (cell + pad), y))
    atomic_save_image(img, path)


# -- the demo -------------------------------------------------------------------------------------------

def _train(argv: list[str]) -> dict:
    """The `difftune train` command path: its flags (the shared ones), then `run`."""
    from .training.config import RunConfig
    from .training.accelerator import reset_accelerate_state
    from .training.recipe import run

    try:
        return run(RunConfig.parse(argv))
    finally:
        reset_accelerate_state()  # each stage builds its own Accelerator, as separate commands do


def run_demo(args) -> dict:
    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    for flag in ("steps", "images", "seeds", "sample_steps", "batch_size", "lora_rank"):
        if getattr(args, flag) < 1:
            raise UserError(f"--{flag} {getattr(args, flag)}: must be at least 1")
    if args.images < args.batch_size:
        raise UserError(f"--images {args.images}: fewer than --batch_size {args.batch_size}")
    model_dir = Path(args.model_dir)
    files = model_files(model_dir)
    out = Path(args.output)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise UserError(f"--output {out}: cannot create it ({err.strerror or err})") from None
    progress = not args.no_progress
    say = print if progress else (lambda *a, **k: None)
    started = time.perf_counter()
    stages: dict = {}
    prompts = eval_prompts()
    texts = [p for p, _, _ in prompts] + [CONTROL_PROMPT]
    colors = [(c, b) for _, c, b in prompts]
    seeds = list(range(args.seeds))

    say(f"difftune demo: teaching the bundled tiny {DEMO_FAMILY} model ({model_dir.name}) to draw a {CONCEPT}")
    data = out / "data"
    metadata = write_concept_dataset(data, args.images, args.seed)
    say(f"fine-tuning set: {args.images} captioned {CONCEPT} images in {data}")

    with measured(stages, "samples_before"):
        pipe = load_pipeline(model_dir)
        before = render_samples(pipe, texts, seeds, args.sample_steps, args.cfg_scale, "samples before", progress)
        del pipe

    common = ["--dataset_base_path", str(data), "--dataset_metadata_path", str(metadata), "--height", "64",
              "--width", "64", "--torch_dtype", "float32", "--lora_base_model", "dit", "--lora_target_modules",
              demo_family().lora_target_modules, "--lora_rank", str(args.lora_rank), "--seed", str(args.seed)]
    if not progress:
        common.append("--no_progress")
    model_paths = json.dumps([files["transformer"], files["text_encoder"], files["vae"]])
    cache = out / "cache"
    say("stage 1 (sft:data_process): text encoder + VAE encode every sample once into the cache")
    with measured(stages, "stage1_data_process"):
        _train(common + ["--task", "sft:data_process", "--model_paths", model_paths, "--output_path", str(cache),
                         "--rebuild_cache"])
    lora_dir = out / "lora"
    # One epoch of the repeated cache covers --steps, in whole batches (no partial batch left over).
    whole = args.batch_size // math.gcd(args.images, args.batch_size)
    repeat = -(-args.steps * args.batch_size // args.images)
    repeat = -(-repeat // whole) * whole
    stage2 = common.copy()
    stage2[1], stage2[2:4] = str(cache), []  # the cache replaces the data set and its metadata
    say("stage 2 (sft:train): the DiT alone trains a LoRA from the cache")
    with measured(stages, "stage2_train"):
        summary = _train(stage2 + ["--task", "sft:train", "--model_paths", json.dumps([files["transformer"]]),
                                   "--output_path", str(lora_dir), "--batch_size", str(args.batch_size),
                                   "--dataset_repeat", str(repeat), "--max_steps", str(args.steps),
                                   "--learning_rate", str(args.learning_rate), "--lr_scheduler", "cosine",
                                   "--lr_warmup_steps", str(min(20, args.steps // 10)), "--num_epochs", "1"])
    lora = str(summary["saved"][-1])
    losses = [float(v) for v in summary["losses"]]

    with measured(stages, "samples_after"):
        pipe = load_pipeline(model_dir, lora=lora)
        after = render_samples(pipe, texts, seeds, args.sample_steps, args.cfg_scale, "samples after", progress)
        del pipe

    draw_loss_curve(losses, out / "loss.png")
    from .shapes import ShapeSpec, render

    references = [render(ShapeSpec(CONCEPT, c, b)) for c, b in colors] + [render(ShapeSpec("circle", "green", "white"))]
    rows, columns = [], []
    for k, seed in enumerate(seeds):
        rows.append((f"before\nseed {seed}", before[k]))
    for k, seed in enumerate(seeds):
        rows.append((f"after\nseed {seed}", after[k]))
    rows.append(("reference", references))
    columns = [t.replace(" on a ", "\non a ") for t in texts]
    draw_grid(rows, columns, out / "samples.png")

    score_before = concept_scores([r[: len(colors)] for r in before], colors)
    score_after = concept_scores([r[: len(colors)] for r in after], colors)
    result = {
        "concept": CONCEPT,
        "base_model": str(model_dir),
        "lora": lora,
        "cache": str(cache),
        "steps": summary["steps"],
        "batch_size": args.batch_size,
        "images": args.images,
        "stages": stages,
        "total_seconds": round(time.perf_counter() - started, 2),
        "loss_first_10": round(sum(losses[:10]) / max(1, len(losses[:10])), 4),
        "loss_last_10": round(sum(losses[-10:]) / max(1, len(losses[-10:])), 4),
        "metric": {
            "name": "star_iou",
            "description": ("mean IoU of each sample's foreground (pixels nearer the prompt's shape colour than its "
                            "background colour) with a star of the same centroid and area; 1 = a perfect star. "
                            "star_fraction: share of samples whose foreground matches a star better than a circle, "
                            "square or triangle."),
            "before": score_before["star_iou"],
            "after": score_after["star_iou"],
            "improvement": round(score_after["star_iou"] - score_before["star_iou"], 4),
            "star_fraction_before": score_before["star_fraction"],
            "star_fraction_after": score_after["star_fraction"],
            "per_image_before": score_before["per_image"],
            "per_image_after": score_after["per_image"],
        },
        "prompts": texts,
        "seeds": seeds,
        "sample_steps": args.sample_steps,
        "cfg_scale": args.cfg_scale,
        "files": {"lora": lora, "cache": str(cache), "loss_curve": str(out / "loss.png"),
                  "samples": str(out / "samples.png"), "data": str(metadata)},
    }
    atomic_write_text(out / "summary.json", json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    args = demo_parser().parse_args(argv)
    result = run_demo(args)
    m, s = result["metric"], result["stages"]
    print(f"stage 1: {s['stage1_data_process']['seconds']} s, peak RSS {s['stage1_data_process']['peak_rss_mib']} MiB; "
          f"stage 2: {result['steps']} steps in {s['stage2_train']['seconds']} s, peak RSS "
          f"{s['stage2_train']['peak_rss_mib']} MiB")
    print(f"star IoU of the samples: {m['before']:.3f} before -> {m['after']:.3f} after "
          f"({m['star_fraction_before']:.0%} -> {m['star_fraction_after']:.0%} look like a star)")
    print(f"wrote {args.output}/: lora/, cache/, loss.png, samples.png, summary.json "
          f"({result['total_seconds']:.0f} s in total)")
    return 0
