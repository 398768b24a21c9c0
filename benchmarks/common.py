"""Shared pieces of the benchmarks: model configurations, data, measured runs, the doc tables.

Every measured run is the CLI path (`difftune.training.recipe.run`) in a fresh process (one per
configuration), so peak RSS (`VmHWM`) belongs to that configuration alone. Timing comes from hooks, not
from the code under test: a global optimizer-step hook stamps every optimizer step, the training loop's
DataLoader is wrapped to time each `next()`, and the cache writer's `write`/`close` are stamped in stage 1.

`python benchmarks/common.py --child '<json>'` is the child entry point (it prints one `BENCH_RESULT`
line); the benchmark scripts never call it by hand.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from difftune.io import atomic_write_text
from difftune.families.qwen_image.components import LORA_TARGET_MODULES as LORA_TARGETS

ROOT = Path(__file__).resolve().parents[1]
# The tiny models come from the tests' support package (tests/support/, which is not installed with difftune). The
# benchmarks run as scripts: importing this module puts tests/ on the path, once for all of them.
if str(ROOT / "tests") not in sys.path:
    sys.path.insert(0, str(ROOT / "tests"))
DOC = ROOT / "docs" / "benchmarks.md"
RESULT_MARK = "BENCH_RESULT "
PROMPTS = ["a red fox sitting in fresh snow at dawn", "an old stone bridge over a quiet green river",
           "a bowl of ripe lemons on a wooden table", "a lighthouse on a cliff under a stormy sky",
           "a yellow taxi parked on a rainy city street", "a small cabin in a pine forest at dusk",
           "a white sailboat on a calm blue lake", "a cup of black coffee beside an open book"]


@dataclass
class BenchConfig:
    """A model configuration and the fixed training resolution it is measured at."""

    name: str
    spec: dict  # TinyQwenImageSpec fields
    resolution: int
    lora_rank: int = 32
    word_tokenizer: bool = False  # real token counts (see word_tokenizer); the text encoder's vocabulary grows

    def tiny_spec(self):
        from support import TinyQwenImageSpec

        return TinyQwenImageSpec(**self.spec)


def proportional() -> BenchConfig:
    """Qwen-Image's proportions at CPU scale: head width 128 and rope axes (16, 56, 56) as the real DiT,
    a text encoder with ~0.4x the DiT's parameters (Qwen2.5-VL-7B is 8.3B against the DiT's 20.4B) and
    the real ratio of MLP to hidden width, and a small VAE (the smallest of the tiny ones, so stage 1 is
    as cheap as it can be: the conservative choice for split training). 256x256 gives 256 image tokens."""
    return BenchConfig("proportional", dict(
        num_layers=4, num_attention_heads=4, attention_head_dim=128, axes_dims_rope=(16, 56, 56),
        text_hidden=512, text_layers=3, text_heads=4, text_intermediate=2900, mrope_section=(16, 24, 24),
        vae_base_dim=8, vae_dim_mult=(1, 1, 1, 1), vae_num_res_blocks=1), resolution=256, word_tokenizer=True)


def quick() -> BenchConfig:
    """The tests' tiny model: for smoke runs only (the step is pure overhead, not compute)."""
    return BenchConfig("quick", {}, resolution=64, lora_rank=4)


# -- workspace ----------------------------------------------------------------------------------------

def word_tokenizer():
    """The tests' byte-level Qwen2 tokenizer plus BPE merges that make each word of the chat template and of
    PROMPTS one token. Token counts then match the real Qwen tokenizer's: the template's system part is 34
    tokens (the drop count the reference hard-codes) and a prompt is ~48 in all, where one token per byte
    gives ~200 and makes every text-encoder call 4x longer than on the real model."""
    import re

    from transformers import Qwen2Tokenizer

    from difftune.families.qwen_image.units import PROMPT_TEMPLATE
    from support import QWEN_SPECIAL_TOKENS, qwen_tokenizer

    base = qwen_tokenizer()
    vocab = {k: v for k, v in base.get_vocab().items() if k not in QWEN_SPECIAL_TOKENS[1:]}
    merges, seen = [], set()
    for text in [PROMPT_TEMPLATE.replace("{}", " ")] + PROMPTS:
        for piece in re.split(r"<\|[a-z_]+\|>", text):
            for word, _ in base._tokenizer.pre_tokenizer.pre_tokenize_str(piece):
                for i in range(2, len(word) + 1):  # prefix merges: w + o -> wo, wo + r -> wor, ...
                    if (word[:i - 1], word[i - 1]) not in seen:
                        seen.add((word[:i - 1], word[i - 1]))
                        merges.append((word[:i - 1], word[i - 1]))
                    vocab.setdefault(word[:i], len(vocab))
    tok = Qwen2Tokenizer(vocab=vocab, merges=merges)
    tok.add_special_tokens({"additional_special_tokens": QWEN_SPECIAL_TOKENS[1:]})
    tok.model_max_length = 2048
    return tok


@dataclass
class Workspace:
    repo: Path
    data: Path
    metadata: Path
    config: BenchConfig

    def model_paths(self, components=("transformer", "text_encoder", "vae")) -> str:
        from support import tiny_qwen_image_paths

        paths = tiny_qwen_image_paths(self.repo)
        return json.dumps([paths[c] if len(paths[c]) > 1 else paths[c][0] for c in components])


def use_word_tokenizer(repo: Path) -> None:
    """Swap in `word_tokenizer()` and grow the text encoder's vocabulary to match (seeded new rows)."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    tok = word_tokenizer()
    tok.save_pretrained(str(repo / "tokenizer"))
    encoder = Qwen2_5_VLForConditionalGeneration.from_pretrained(str(repo / "text_encoder"))
    torch.manual_seed(0)
    encoder.resize_token_embeddings(len(tok), mean_resizing=False)
    encoder.save_pretrained(str(repo / "text_encoder"), max_shard_size="10GB")


def prepare(workdir: Path, config: BenchConfig, n_images: int) -> Workspace:
    """The model repository (reused when the same spec is already there) and `n_images` images."""
    from support import write_tiny_qwen_image

    workdir = Path(workdir)
    repo = workdir / f"model-{config.name}"

    def write(repo):
        write_tiny_qwen_image(repo, config.tiny_spec(), shard=False)
        if config.word_tokenizer:
            use_word_tokenizer(repo)

    reuse_or_write(repo, {"spec": config.tiny_spec().__dict__, "word_tokenizer": config.word_tokenizer}, write)
    data = workdir / f"data-{config.resolution}-{n_images}"
    metadata = data / "metadata.csv"
    if not metadata.is_file():
        write_images(data, n_images, config.resolution)
    return Workspace(repo, data, metadata, config)


def reuse_or_write(repo: Path, settings, write) -> Path:
    """`repo` as `write(repo)` makes it for `settings` (anything JSON can hold): kept when it was last written for the
    same settings (recorded in its bench_config.json), else written again."""
    marker = repo / "bench_config.json"
    wanted = json.dumps(settings, sort_keys=True, indent=2, default=list)
    if not (marker.is_file() and marker.read_text() == wanted):
        write(repo)
        marker.write_text(wanted)
    return repo


def median_seconds(fn, repeats: int = 3) -> float:
    """The median wall time of `fn()` over `repeats` calls, without autograd (an encoder's forward, timed apart)."""
    import time

    import torch

    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        with torch.no_grad():
            fn()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def write_images(root: Path, n: int, size: int) -> Path:
    """`n` distinct images of size x size (smooth gradients and shapes, so PNG decoding is realistic-ish)."""
    import numpy as np
    from PIL import Image, ImageDraw

    root.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    lines = ["image,prompt"]
    yy, xx = np.mgrid[0:size, 0:size] / size
    for i in range(n):
        a, b, c = rng.uniform(0, 255, 3)
        arr = np.stack([a * xx + (255 - a) * yy, b * (1 - xx), c * yy], -1)
        arr = (arr + rng.normal(0, 8, arr.shape)).clip(0, 255).astype("uint8")
        img = Image.fromarray(arr)
        draw = ImageDraw.Draw(img)
        for _ in range(3):
            x0, y0 = rng.integers(0, size // 2, 2)
            draw.ellipse((int(x0), int(y0), int(x0 + size // 3), int(y0 + size // 3)),
                         fill=tuple(int(v) for v in rng.integers(0, 255, 3)))
        name = f"image_{i + 1:03d}.png"
        img.save(root / name)
        lines.append(f'{name},"{PROMPTS[i % len(PROMPTS)]}"')
    (root / "metadata.csv").write_text("\n".join(lines) + "\n")
    return root / "metadata.csv"


def train_flags(ws: Workspace, task: str, output: Path, *, dataset: Path | None = None, epochs: int = 1,
                repeat: int = 1, components=("transformer", "text_encoder", "vae"), extra=()) -> list[str]:
    """The reference's LoRA command (fp32 on this CPU: it has no native bf16) at a fixed resolution.
    `output` is emptied first: every run is measured from scratch (a stage 1 would otherwise resume)."""
    fresh(output)
    res = str(ws.config.resolution)
    flags = ["--task", task, "--output_path", str(output), "--model_paths", ws.model_paths(components),
             "--height", res, "--width", res, "--torch_dtype", "float32", "--learning_rate", "1e-4",
             "--num_epochs", str(epochs), "--dataset_repeat", str(repeat), "--lora_base_model", "dit",
             "--lora_target_modules", LORA_TARGETS, "--lora_rank", str(ws.config.lora_rank), "--seed", "0",
             "--no_progress", "--enable_tensorboard_log", "false"]
    if dataset is None:
        flags += ["--dataset_base_path", str(ws.data), "--dataset_metadata_path", str(ws.metadata)]
    else:
        flags += ["--dataset_base_path", str(dataset)]
    return flags + [str(e) for e in extra]


def fresh(folder: Path) -> Path:
    """`folder`, removed if a previous run left it (a reused --workdir)."""
    import shutil

    if Path(folder).exists():
        shutil.rmtree(folder)
    return Path(folder)


def realwidth(blocks: int, text_layers: int, resolution: int = 1024) -> BenchConfig:
    """Qwen-Image's real widths with `blocks` of its 60 DiT blocks and `text_layers` of Qwen2.5-VL-7B's 28 layers."""
    return BenchConfig("realwidth", dict(
        num_layers=blocks, num_attention_heads=24, attention_head_dim=128, axes_dims_rope=(16, 56, 56),
        text_hidden=3584, text_layers=text_layers, text_heads=28, text_intermediate=18944, mrope_section=(16, 24, 24),
        vae_base_dim=96, vae_dim_mult=(1, 2, 4, 4), vae_num_res_blocks=2), resolution=resolution, word_tokenizer=True)


def device_workspace(wd: Path, cfg: BenchConfig, n: int) -> Workspace:
    """`prepare`, with the models built on the GPU when there is one (random init of billions of parameters)."""
    import torch

    from support import write_tiny_qwen_image

    if cfg.name == "quick":
        return prepare(wd, cfg, n)
    repo = wd / f"model-{cfg.name}"

    def write(repo):
        with torch.device("cuda" if torch.cuda.is_available() else "cpu"):
            write_tiny_qwen_image(repo, cfg.tiny_spec(), shard=False)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the measured runs are other processes: give them the memory back
        use_word_tokenizer(repo)

    reuse_or_write(repo, {"spec": cfg.tiny_spec().__dict__, "word_tokenizer": True}, write)
    data = wd / f"data-{cfg.resolution}-{n}"
    if not (data / "metadata.csv").is_file():
        write_images(data, n, cfg.resolution)
    return Workspace(repo, data, data / "metadata.csv", cfg)


# -- measured runs ------------------------------------------------------------------------------------

def status_kb(field: str) -> int:
    """A field of /proc/self/status in KiB (VmRSS, VmHWM)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


@contextlib.contextmanager
def _instrumented(record: dict):
    """Stamp optimizer steps, loader waits in the training loop and stage-1 cache writes into `record`."""
    from torch.optim.optimizer import register_optimizer_step_post_hook

    import difftune.training.fit as loop  # where the training data loader is built
    from difftune.cache import CacheWriter

    import torch

    steps, waits, writes = record["step_stamps"], record["loader_waits"], record["write_stamps"]
    cuda = torch.cuda.is_available()

    def stamp(*_):
        if cuda:  # kernels run ahead of Python: a step ends when the GPU has done its work
            torch.cuda.synchronize()
        steps.append(time.perf_counter())

    hook = register_optimizer_step_post_hook(stamp)
    base_loader = loop.DataLoader

    class TimedLoader(base_loader):
        def __iter__(self):
            it = super().__iter__()
            while True:
                start = time.perf_counter()
                try:
                    item = next(it)
                except StopIteration:
                    return
                waits.append(time.perf_counter() - start)
                yield item

    write, close = CacheWriter.write, CacheWriter.close

    def timed_write(self, *a, **k):
        out = write(self, *a, **k)
        writes.append(time.perf_counter())
        return out

    def timed_close(self, *a, **k):
        out = close(self, *a, **k)
        record["close_stamp"] = time.perf_counter()
        return out

    loop.DataLoader, CacheWriter.write, CacheWriter.close = TimedLoader, timed_write, timed_close
    try:
        yield
    finally:
        hook.remove()
        loop.DataLoader, CacheWriter.write, CacheWriter.close = base_loader, write, close


def measure_difftune(argv: list[str]) -> dict:
    """One `difftune train` run in this process, instrumented. Heavy libraries are imported first so
    `rss_before_kb` is the interpreter + libraries baseline."""
    import accelerate  # noqa: F401
    import diffusers  # noqa: F401
    import peft  # noqa: F401
    import transformers  # noqa: F401

    from difftune.cli.args import training_parser
    from difftune.training.recipe import run

    args = training_parser().parse_args(argv)
    record = {"step_stamps": [], "loader_waits": [], "write_stamps": [], "close_stamp": None}
    rss_before = status_kb("VmRSS")
    with _instrumented(record):
        start = time.perf_counter()
        summary = run(args)
        end = time.perf_counter()
    record.update(start=start, end=end, run_seconds=end - start, rss_before_kb=rss_before,
                  vmhwm_kb=status_kb("VmHWM"), steps=summary.get("steps") if isinstance(summary, dict) else None)
    import torch

    if torch.cuda.is_available():  # torch's allocator: what tensors held at most, and what it took from the driver
        record.update(gpu_peak_allocated_mib=torch.cuda.max_memory_allocated() / 2**20,
                      gpu_peak_reserved_mib=torch.cuda.max_memory_reserved() / 2**20)
    return record


def child_command(python: str, script: Path, payload: dict) -> list[str]:
    return [python, str(script), "--child", json.dumps(payload)]


def run_child(cmd: list[str], threads: int, timeout: float | None = None, env: dict | None = None) -> dict:
    """Run a child process that prints one BENCH_RESULT line; adds `wall_seconds` (process wall time).
    `threads` caps the intra-op threads of every library (OpenMP, MKL) the same way for every run. The timeout
    defaults to $DIFFTUNE_BENCH_CHILD_TIMEOUT seconds, else 900 (a leased GPU's minutes are few)."""
    timeout = timeout or float(os.environ.get("DIFFTUNE_BENCH_CHILD_TIMEOUT", 900))
    full_env = dict(os.environ, TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error",
                    OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads),
                    HF_HUB_DISABLE_PROGRESS_BARS="1", PYTHONPATH=os.pathsep.join(
                        [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    full_env.update(env or {})
    start = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env, cwd=str(ROOT))
    wall = time.perf_counter() - start
    lines = [line for line in proc.stdout.splitlines() if line.startswith(RESULT_MARK)]
    if proc.returncode != 0 or not lines:
        tail = (proc.stdout[-1500:] + "\n" + proc.stderr[-3000:]).strip()
        raise RuntimeError(f"benchmark child failed (exit {proc.returncode}): {' '.join(cmd[:3])} ...\n{tail}")
    result = json.loads(lines[-1][len(RESULT_MARK):])
    result["wall_seconds"] = wall
    return result


def run_difftune(argv: list[str], isolated: bool = True, threads: int = 1) -> dict:
    """A measured difftune run: in a fresh process (`isolated`), or in this one (smoke runs)."""
    if isolated:
        return run_child(child_command(sys.executable, Path(__file__), {"kind": "difftune", "argv": argv}), threads)
    import torch

    torch.set_num_threads(threads)
    start = time.perf_counter()
    try:
        record = measure_difftune(argv)
    finally:
        reset_accelerate()
    record["wall_seconds"] = time.perf_counter() - start
    return record


def reset_accelerate() -> None:
    """Accelerate's state is process-global; in-process runs start from a clean one."""
    from difftune.training.accelerator import reset_accelerate_state

    reset_accelerate_state()


# -- statistics ---------------------------------------------------------------------------------------

def step_intervals(record: dict, warmup: int) -> list[float]:
    """Seconds between consecutive optimizer steps, the first `warmup` intervals dropped."""
    s = record["step_stamps"]
    return [b - a for a, b in zip(s[:-1], s[1:])][warmup:]


def step_time(record: dict, warmup: int) -> float:
    """Median step time after warm-up (the median ignores the few steps that also save a checkpoint)."""
    intervals = step_intervals(record, warmup)
    if not intervals:
        raise RuntimeError("too few steps to measure: raise the step count")
    return statistics.median(intervals)


def data_wait_share(record: dict, warmup: int) -> float:
    """Time blocked in the loader's next() over total step time, for the measured steps. Interval j
    (between steps j and j+1) contains the wait for batch j+1."""
    intervals = step_intervals(record, warmup)
    waits = record["loader_waits"][warmup + 1: warmup + 1 + len(intervals)]
    return sum(waits) / sum(intervals[:len(waits)]) if waits else float("nan")


def stage1_rate(record: dict, batch: int) -> float:
    """Samples per second written by stage 1 after its first batch (model loading and warm-up excluded),
    up to the writer's close (the last flush included)."""
    w = record["write_stamps"]
    end = record.get("close_stamp") or w[-1]
    first = w[min(batch, len(w)) - 1]
    done = len(w) - min(batch, len(w))
    if done <= 0 or end <= first:
        raise RuntimeError("too few stage-1 samples to measure: raise the sample count")
    return done / (end - first)


def cache_bytes(cache_dir: Path) -> dict:
    """Bytes on disk of a cache against the bytes of the tensors it holds (from the safetensors headers)."""
    from safetensors import safe_open

    total = sum(p.stat().st_size for p in Path(cache_dir).rglob("*") if p.is_file())
    tensor_bytes = 0
    for shard in Path(cache_dir).rglob("*.safetensors"):
        with safe_open(str(shard), "pt") as f:
            for key in f.keys():
                t = f.get_slice(key)
                numel = 1
                for d in t.get_shape():
                    numel *= d
                tensor_bytes += numel * _itemsize(t.get_dtype())
    samples = 0
    for index in Path(cache_dir).rglob("shard-*.json"):
        samples += len(json.loads(index.read_text()).get("samples", {}))
    return {"disk_bytes": total, "tensor_bytes": tensor_bytes, "samples": samples}


def _itemsize(dtype: str) -> int:
    return {"F64": 8, "I64": 8, "F32": 4, "I32": 4, "F16": 2, "BF16": 2, "I16": 2, "I8": 1, "U8": 1, "BOOL": 1,
            "F8_E4M3": 1, "F8_E5M2": 1}[dtype]


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


# -- split vs one stage -----------------------------------------------------------------------------

MIB = 1024.0


def param_counts(repo: Path, folders: dict[str, str]) -> dict[str, int]:
    """Parameters per component ({name: glob of its files under `repo`}), from the safetensors headers alone."""
    from safetensors import safe_open

    counts = {}
    for name, pattern in folders.items():
        total = 0
        for path in sorted(repo.glob(pattern)):
            with safe_open(str(path), "pt") as f:
                for key in f.keys():
                    n = 1
                    for d in f.get_slice(key).get_shape():
                        n *= d
                    total += n
        counts[name] = total
    return counts


def split_figures(one: dict, s1: dict, s2: dict, warmup: int, ref_steps: int, tag: str) -> dict:
    """What a split-vs-one-stage benchmark reports from its three runs (one stage, stage 1, stage 2): totals, step
    times, peak RSS and their ratios, and `projected_total_time_ratio_<tag>`: the total-time ratio at the
    reference's `ref_steps` optimizer steps, each run's fixed cost (loading, stage 1, saving) plus that many steps
    at its measured step time."""
    t1, t2 = step_time(one, warmup), step_time(s2, warmup)
    total_one, total_split = one["run_seconds"], s1["run_seconds"] + s2["run_seconds"]
    fixed_one, fixed_two = total_one - one["steps"] * t1, total_split - s2["steps"] * t2
    net_one, net_two = one["vmhwm_kb"] - one["rss_before_kb"], s2["vmhwm_kb"] - s2["rss_before_kb"]
    return {
        "total_time_one_stage_s": total_one, "total_time_split_s": total_split,
        "stage1_seconds": s1["run_seconds"], "stage2_seconds": s2["run_seconds"],
        "total_time_ratio": ratio(total_split, total_one),
        f"projected_total_time_ratio_{tag}": ratio(fixed_two + ref_steps * t2, fixed_one + ref_steps * t1),
        "step_time_one_stage_s": t1, "step_time_stage2_s": t2, "step_time_ratio": ratio(t2, t1),
        "peak_rss_one_stage_mib": one["vmhwm_kb"] / MIB, "peak_rss_stage1_mib": s1["vmhwm_kb"] / MIB,
        "peak_rss_stage2_mib": s2["vmhwm_kb"] / MIB, "peak_rss_ratio": ratio(s2["vmhwm_kb"], one["vmhwm_kb"]),
        "baseline_rss_mib": one["rss_before_kb"] / MIB, "peak_rss_above_baseline_ratio": ratio(net_two, net_one),
    }


def split_rows(r: dict, samples: str, ref_repeat: int, tag: str) -> list[list]:
    """The table rows of `split_figures` (`samples`: what one epoch is, e.g. "4 images")."""
    n = int(samples.split()[0])
    epochs = f" x {r['epochs']} epochs" if r.get("epochs", 1) > 1 else ""
    return [
        [f"total time (s), {samples}{epochs} x repeat {r['repeat']} = {r['steps']} steps; split = stage 1 + stage 2",
         r["total_time_one_stage_s"], r["total_time_split_s"], r["total_time_ratio"]],
        [f"projected to --num_epochs 5 --dataset_repeat {ref_repeat} ({n * 5 * ref_repeat} steps)", "", "",
         r[f"projected_total_time_ratio_{tag}"]],
        ["step time (s, median after warm-up)", r["step_time_one_stage_s"], r["step_time_stage2_s"],
         r["step_time_ratio"]],
        ["peak RSS (MiB, VmHWM)", r["peak_rss_one_stage_mib"], r["peak_rss_stage2_mib"], r["peak_rss_ratio"]],
        [f"peak RSS above the {r['baseline_rss_mib']:.0f} MiB interpreter+libraries baseline",
         r["peak_rss_one_stage_mib"] - r["baseline_rss_mib"], r["peak_rss_stage2_mib"] - r["baseline_rss_mib"],
         r["peak_rss_above_baseline_ratio"]],
    ]


# -- machine, doc ------------------------------------------------------------------------------------

def machine(threads: int) -> dict:
    import importlib.metadata as md

    cpu = platform.processor() or platform.machine()
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    versions = {}
    for name in ("torch", "diffusers", "transformers", "peft", "accelerate", "difftune"):
        with contextlib.suppress(md.PackageNotFoundError):
            versions[name] = md.version(name)
    return {"date": datetime.date.today().isoformat(), "cpu": cpu, "cores": os.cpu_count(),
            "python": platform.python_version(), "versions": versions, "load_start": os.getloadavg()[0],
            "threads": threads}


def machine_line(info: dict) -> str:
    v = ", ".join(f"{k} {val}" for k, val in info["versions"].items())
    info.setdefault("load_end", os.getloadavg()[0])  # rendered before the JSON line: both carry it
    load = f"load average {info['load_start']:.1f} at start, {info['load_end']:.1f} at end"
    return (f"_Measured {info['date']} on a {info['cores']}-core {info['cpu']} (no GPU), {info['threads']} "
            f"intra-op thread(s) per run, {load}; {v}._")


def table(header: list[str], rows: list[list]) -> str:
    def fmt(v):
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(fmt(v) for v in row) + " |" for row in rows]
    return "\n".join(lines)


def verdict(value: float, target: float, at_most: bool = True) -> str:
    met = value <= target if at_most else value >= target
    return "met" if met else "**not met**"


def update_doc(doc: Path | None, section: str, body: str) -> None:
    """Replace the text between `<!-- bench:section -->` and `<!-- /bench:section -->` (appended if absent)."""
    if doc is None:
        return
    doc = Path(doc)
    start, end = f"<!-- bench:{section} -->", f"<!-- /bench:{section} -->"
    text = doc.read_text() if doc.is_file() else "# Benchmarks\n"
    block = f"{start}\n{body.strip()}\n{end}"
    if start in text and end in text:
        head, rest = text.split(start, 1)
        text = head + block + rest.split(end, 1)[1]
    else:
        text = text.rstrip() + "\n\n" + block + "\n"
    atomic_write_text(doc, text)


def base_parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    p.add_argument("--quick", action="store_true", help="tiny model, few steps, in-process runs (a smoke test)")
    p.add_argument("--workdir", default=None, help="where models, data and outputs go (default: a temp dir)")
    p.add_argument("--doc", default=None, help=f"the doc to update (default {DOC.relative_to(ROOT)}; "
                                               "none with --quick unless given)")
    p.add_argument("--no-doc", action="store_true", help="do not update any doc")
    p.add_argument("--threads", type=int, default=1,
                   help="intra-op threads per run (default 1: on a shared 2-core machine two OpenMP threads "
                        "spin-wait whenever another process holds a core, and step times swing 3-10x)")
    return p


def resolve_doc(args) -> Path | None:
    if args.no_doc:
        return None
    if args.doc:
        return Path(args.doc)
    return None if args.quick else DOC


@contextlib.contextmanager
def workdir_of(args):
    import tempfile

    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
        yield Path(args.workdir)
    else:
        with tempfile.TemporaryDirectory(prefix="difftune-bench-") as d:
            yield Path(d)


def emit(result: dict) -> None:
    print(json.dumps(result, sort_keys=True), flush=True)


def _measure_child(payload: dict) -> dict:
    import torch

    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    if payload["kind"] == "difftune":
        record = measure_difftune(payload["argv"])
    else:
        raise SystemExit(f"unknown child kind {payload['kind']}")
    return record


def child_main(measure) -> None:
    """A child process's entry point: `--child '<json>'` -> `measure(payload)` -> one BENCH_RESULT line."""
    cli = argparse.ArgumentParser()
    cli.add_argument("--child", required=True)
    print(RESULT_MARK + json.dumps(measure(json.loads(cli.parse_args().child))), flush=True)


if __name__ == "__main__":
    child_main(_measure_child)

__all__ = ["BenchConfig", "proportional", "quick", "prepare", "train_flags", "run_difftune", "step_time",
           "data_wait_share", "stage1_rate", "cache_bytes", "update_doc", "machine", "table", "asdict"]
