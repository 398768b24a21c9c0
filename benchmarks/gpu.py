"""GPU: split against one-stage training at real width, and FSDP2 full training against one process.

For a lease of a GPU machine (H100 / H200): one script, parts run in order, each writing `<part>.json` to --out
as soon as it ends (a part that fails writes its error instead, and the next part still runs):
- `parity`: the tests' tiny Qwen-Image in fp32 on the GPU, a LoRA trained one stage and split; the largest
  difference of the two LoRAs (the split's equality on CUDA kernels).
- `split` (issue 6): a few real-width Qwen-Image blocks (24 heads of 128, text width 3584) with the real VAE's
  architecture and a text encoder of Qwen2.5-VL-7B's widths at ~0.35x the DiT's parameters (the real ratio is
  0.4x), 1024x1024 images, bf16, LoRA rank 32 on the reference's 12 target modules with gradient checkpointing:
  one stage (`sft`) against `sft:data_process` + `sft:train`. Step time, peak GPU memory (torch's allocator) and
  model-FLOPs utilisation against the GPU's dense bf16 peak.
- `fsdp` (issue 26): full training of those blocks (`--trainable_models dit`) from the split part's cache, one
  process against `accelerate launch --config_file examples/accelerate/fsdp.yaml` on every GPU of the machine
  (and DDP where there are two or more): step time, peak GPU memory, the checkpoints' largest difference.
- `demo`: `difftune demo` (the README's main job) on the GPU.
- `mfu` (issue 33): stage-2 LoRA MFU of Qwen-Image, FLUX.1, Wan 14B and Z-Image at real block width (`--mfu_blocks`
  blocks each), with and without gradient checkpointing (benchmarks/gpu_families.py).
- `reference` (issue 33): difftune's stage-2 step against DiffSynth-Studio's own on the same Qwen-Image blocks and
  GPU (`--ds-python` or `--diffsynth_src`; skipped, saying why, without either).

    python benchmarks/gpu.py --workdir /tmp/gpu --out DIR        # on the GPU machine
    python benchmarks/gpu.py --render DIR                        # here: DIR's JSON into docs/benchmarks.md
    python benchmarks/gpu.py --quick --parts parity,split,fsdp   # smoke run on this CPU (tiny model)
    python benchmarks/gpu.py --quick --parts mfu,reference --out DIR   # the issue-33 parts' smoke run (tiny models)
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (ROOT, BenchConfig, base_parser, device_workspace, fresh, param_counts, prepare, quick,  # noqa: E402
                    ratio, realwidth, resolve_doc, run_child, run_difftune, step_time, table, train_flags,
                    update_doc, workdir_of)

PARTS = ("split", "fsdp", "parity", "stage1", "profile", "demo", "mfu", "reference")
# Dense bf16 tensor-core peak (NVIDIA's data sheets, SXM): the H200 has the H100's compute with more memory.
BF16_PEAK = {"H100": 989.4e12, "H200": 989.4e12}


# -- FLOPs -------------------------------------------------------------------------------------------

def dit_flops(spec: dict, image_tokens: int, text_tokens: int) -> dict:
    """Forward FLOPs of the Qwen-Image DiT for one sample: the linear layers each stream's tokens pass (per block
    attention q/k/v/out and a 4x MLP, image and text streams apart: 24 D^2 per token; the modulation runs once per
    sample and is left out), the embedders and the output projection, and joint attention (4 S^2 D per block)."""
    d = spec["num_attention_heads"] * spec["attention_head_dim"]
    s = image_tokens + text_tokens
    linear = spec["num_layers"] * 24 * d * d * s + 2 * d * (64 * image_tokens * 2 + spec["text_hidden"] * text_tokens)
    attention = spec["num_layers"] * 4 * s * s * d
    return {"linear": linear, "attention": attention}


def training_flops(fwd: dict, full: bool, recompute: bool) -> dict:
    """Model FLOPs of a training step (frozen linears take only input gradients: 1x forward; trained ones 2x;
    attention's backward is 2x its forward) and the hardware FLOPs with the checkpointed forward run again.
    LoRA adapters' own FLOPs (rank / width of the base layer's) are left out."""
    model = (3 if full else 2) * fwd["linear"] + 3 * fwd["attention"]
    return {"model": model, "hardware": model + (fwd["linear"] + fwd["attention"] if recompute else 0)}


def cached_text_tokens(cache: Path) -> float:
    """The mean prompt length in tokens, read from the stage-1 cache (the prompt embeddings' sequence length)."""
    from safetensors import safe_open

    lengths = []
    for shard in sorted(cache.rglob("*.safetensors")):
        with safe_open(str(shard), "pt") as f:
            for key in f.keys():
                if key.endswith("/prompt_embeds"):
                    lengths.append(f.get_slice(key).get_shape()[-2])
    if not lengths:
        raise RuntimeError(f"no prompt embeddings in the cache {cache}")
    return sum(lengths) / len(lengths)


# -- parts -------------------------------------------------------------------------------------------

def max_diff(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    x, y = load_file(str(a)), load_file(str(b))
    if x.keys() != y.keys():
        raise RuntimeError(f"{a} and {b} hold different tensors")
    return max((x[k].float() - y[k].float()).abs().max().item() for k in x)


def saved(output: Path) -> Path:
    files = sorted(output.glob("*.safetensors"))
    if not files:
        raise RuntimeError(f"no checkpoint in {output}")
    return files[-1]


def part_parity(wd: Path, args) -> dict:
    ws = prepare(wd, quick(), 2)
    one = run_difftune(train_flags(ws, "sft", wd / "p-one", repeat=2), True, args.threads)
    run_difftune(train_flags(ws, "sft:data_process", wd / "p-cache", components=("text_encoder", "vae")), True,
                 args.threads)
    two = run_difftune(train_flags(ws, "sft:train", wd / "p-two", dataset=wd / "p-cache", repeat=2,
                                   components=("transformer",)), True, args.threads)
    return {"steps": one["steps"], "steps_split": two["steps"], "dtype": "float32",
            "lora_max_diff": max_diff(saved(wd / "p-one"), saved(wd / "p-two"))}


def precision(args, checkpointing: bool = True) -> list[str]:
    return ["--torch_dtype", args.dtype] + (["--use_gradient_checkpointing"] if checkpointing else [])


def part_split(wd: Path, args, cfg: BenchConfig) -> dict:
    n, repeat, warmup = args.images, args.repeat, args.warmup
    ws = device_workspace(wd, cfg, n)
    params = param_counts(ws.repo, {"dit": "transformer/*.safetensors", "text_encoder": "text_encoder/*.safetensors",
                                    "vae": "vae/*.safetensors"})
    extra = precision(args)
    one = run_difftune(train_flags(ws, "sft", wd / "one", repeat=repeat, extra=extra), True, args.threads)
    s1 = run_difftune(train_flags(ws, "sft:data_process", wd / "cache", components=("text_encoder", "vae"),
                                  extra=extra), True, args.threads)
    s2 = run_difftune(train_flags(ws, "sft:train", wd / "two", dataset=wd / "cache", repeat=repeat,
                                  components=("transformer",), extra=extra), True, args.threads)
    t1, t2 = step_time(one, warmup), step_time(s2, warmup)
    tokens = (cfg.resolution // 16) ** 2
    text = cached_text_tokens(wd / "cache")
    flops = training_flops(dit_flops(cfg.tiny_spec().__dict__, tokens, round(text)), full=False,
                           recompute=True)
    return {"config": cfg.name, "spec": cfg.tiny_spec().__dict__, "resolution": cfg.resolution, "images": n, "repeat": repeat,
            "warmup_steps": warmup, "steps": one["steps"], "dtype": args.dtype, "params": params, "image_tokens": tokens,
            "text_tokens": text, "dit_model_flops_per_step": flops["model"],
            "dit_hardware_flops_per_step": flops["hardware"], "lora_rank": cfg.lora_rank,
            "step_time_one_stage_s": t1, "step_time_stage2_s": t2, "step_time_ratio": ratio(t2, t1),
            "stage1_seconds": s1["run_seconds"], "stage1_samples_per_s": n / s1["run_seconds"],
            "total_time_one_stage_s": one["run_seconds"],
            "total_time_split_s": s1["run_seconds"] + s2["run_seconds"],
            "runs": {"one": one, "stage1": s1, "stage2": s2}}


def part_stage1(wd: Path, args, cfg: BenchConfig) -> dict:
    """Stage 1 with samples of equal size encoded 8 at a time (the default) against one at a time: samples/s after
    the first batch and peak GPU memory."""
    from common import stage1_rate

    n = max(16, args.images)
    ws = device_workspace(wd, cfg, n)
    out = {"images": n, "resolution": cfg.resolution, "dtype": args.dtype}
    for batch in (1, 8):
        r = run_difftune(train_flags(ws, "sft:data_process", wd / f"cache-b{batch}", components=("text_encoder", "vae"),
                                     extra=[*precision(args), "--data_process_batch_size", str(batch)]),
                         True, args.threads)
        out[f"batch{batch}"] = {"samples_per_s": stage1_rate(r, batch), **{k: r.get(k) for k in (
            "run_seconds", "gpu_peak_allocated_mib", "gpu_peak_reserved_mib", "vmhwm_kb")}}
    out["batched_speedup"] = ratio(out["batch8"]["samples_per_s"], out["batch1"]["samples_per_s"])
    return out


def part_profile(wd: Path, args, cfg: BenchConfig) -> dict:
    """Where a stage-2 step's time goes: torch.profiler over 5 steps after warm-up (the top operators by GPU time
    and by CPU time, the GPU's busy share), and the step time without gradient checkpointing."""
    ws = device_workspace(wd, cfg, args.images)
    if not (wd / "cache").is_dir():
        raise RuntimeError("the profile part trains from the split part's cache: run `split` first")
    out, profiled = {}, 5
    repeat = -(-(args.warmup + profiled + 6) // args.images)  # enough steps to time after the profiled ones
    for ckpt in (True, False):
        argv = train_flags(ws, "sft:train", wd / "prof", dataset=wd / "cache", repeat=repeat,
                           components=("transformer",), extra=precision(args, ckpt))
        payload = {"kind": "profile", "argv": argv, "start": args.warmup, "steps": profiled,
                   "out": str(Path(args.out) / f"profile{'' if ckpt else '_nockpt'}.txt")}
        r = run_child([sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(payload)], args.threads)
        key = "checkpointing" if ckpt else "no_checkpointing"
        out[key] = {"step_time_s": step_time(r, args.warmup + profiled + 1),
                    "gpu_busy_s_per_step": r.get("gpu_busy_s_per_step"),
                    "gpu_peak_allocated_mib": r.get("gpu_peak_allocated_mib")}
    return out


def _profile_child(payload: dict) -> dict:
    """In a child process: a measured run with torch.profiler over optimizer steps [start, start + steps)."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook
    from torch.profiler import ProfilerActivity, profile

    from common import measure_difftune

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof, count = profile(activities=activities), [0]

    def hook(*_):
        count[0] += 1
        if count[0] == payload["start"]:
            prof.start()
        elif count[0] == payload["start"] + payload["steps"]:
            if torch.cuda.is_available():
                torch.cuda.synchronize()
            prof.stop()

    register_optimizer_step_post_hook(hook)
    record = measure_difftune(payload["argv"])
    if count[0] < payload["start"] + payload["steps"]:
        raise RuntimeError(f"{count[0]} optimizer steps: too few to profile steps {payload['start']} + {payload['steps']}")
    events = prof.key_averages()
    tables = []
    for key in ("device_time_total", "cuda_time_total", "self_cpu_time_total"):
        try:
            tables.append(f"sorted by {key}\n" + events.table(sort_by=key, row_limit=30, max_name_column_width=70))
        except (AttributeError, KeyError, ValueError):
            continue
    Path(payload["out"]).write_text("\n\n".join(tables))
    record["gpu_busy_s_per_step"] = _profile_total(Path(payload["out"])) / payload["steps"]
    return record


def launched(config: Path, processes: int, argv: list[str], threads: int) -> dict:
    """A measured `difftune train` under `accelerate launch --config_file config` (rank 0's record)."""
    payload = {"kind": "difftune", "argv": argv}
    cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", str(config),
           "--num_processes", str(processes), "--main_process_port", "0", "--mixed_precision", "no",  # as the
           "--dynamo_backend", "no", str(Path(__file__).parent / "common.py"),  # one-process run: --torch_dtype decides
           "--child", json.dumps(payload)]
    return run_child(cmd, threads)


def part_fsdp(wd: Path, args, cfg: BenchConfig) -> dict:
    import torch

    ws = device_workspace(wd, cfg, args.images)
    if not (wd / "cache").is_dir():
        raise RuntimeError("the fsdp part trains from the split part's cache: run `split` first")
    gpus = max(1, torch.cuda.device_count())
    res = str(cfg.resolution)

    def argv(output: Path) -> list[str]:
        fresh(output)
        return ["--task", "sft:train", "--dataset_base_path", str(wd / "cache"), "--model_paths",
                ws.model_paths(("transformer",)), "--height", res, "--width", res, *precision(args), "--learning_rate",
                "1e-5", "--trainable_models", "dit", "--seed", "0", "--no_progress", "--enable_tensorboard_log",
                "false", "--num_epochs", "1", "--dataset_repeat", str(args.repeat), "--batch_size", "1",
                "--gradient_accumulation_steps", str(gpus), "--output_path", str(output)]

    runs = {"one": run_difftune(argv(wd / "full-one"), True, args.threads)}
    examples = ROOT / "examples" / "accelerate"
    if torch.cuda.is_available():
        for kind, config in (("fsdp2", "fsdp.yaml"), ("ddp", "multi_gpu_ddp.yaml")):
            if kind == "ddp" and gpus < 2:
                continue  # DDP on one GPU is the one-process run
            a = argv(wd / f"full-{kind}")
            a[a.index("--gradient_accumulation_steps") + 1] = "1"  # gpus x batch 1: the same samples per step
            runs[kind] = launched(examples / config, gpus, a + (["--find_unused_parameters"] if kind == "ddp" else []),
                                  args.threads)
    fwd = dit_flops(cfg.tiny_spec().__dict__, (cfg.resolution // 16) ** 2,
                    round(cached_text_tokens(wd / "cache")))
    out = {"config": cfg.name, "dtype": args.dtype, "gpus": gpus, "spec": cfg.tiny_spec().__dict__, "params_dit": param_counts(
        ws.repo, {"dit": "transformer/*.safetensors"})["dit"], "dit_model_flops_per_sample": training_flops(
            fwd, full=True, recompute=True)["model"], "runs": runs}
    for kind, record in runs.items():
        out[f"step_time_{kind}_s"] = step_time(record, args.warmup)
        if kind != "one":
            out[f"max_diff_{kind}_vs_one"] = max_diff(saved(wd / "full-one"), saved(wd / f"full-{kind}"))
    return out


def part_demo(wd: Path, args) -> dict:
    out = fresh(wd / "demo")
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "difftune.cli.main", "demo", "--output", str(out)],
                          capture_output=True, text=True, timeout=args.part_timeout, cwd=str(ROOT),
                          env=dict(os.environ, PYTHONPATH=os.pathsep.join(
                              [str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep)))
    if proc.returncode != 0:
        raise RuntimeError(f"difftune demo exited {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-3000:]}")
    return {"wall_seconds": time.perf_counter() - start, "summary": json.loads((out / "summary.json").read_text()),
            "stdout_tail": proc.stdout[-1500:]}


def device_info() -> dict:
    import datetime
    import importlib.metadata as md
    import platform

    import torch

    info = {"date": datetime.date.today().isoformat(), "python": platform.python_version(),
            "torch": torch.__version__, "cuda": torch.version.cuda, "cpus": os.cpu_count(), "versions": {}}
    for name in ("diffusers", "transformers", "peft", "accelerate"):
        try:
            info["versions"][name] = md.version(name)
        except md.PackageNotFoundError:
            pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, gpus=torch.cuda.device_count(), gpu_memory_gib=p.total_memory / 2**30)
        info["bf16_peak"] = next((v for k, v in BF16_PEAK.items() if k in p.name), None)
        a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
        for _ in range(3):
            a @ a
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()
        info["matmul_bf16_flops"] = 10 * 2 * 8192**3 / (time.perf_counter() - start)  # what this card reaches
        del a
        torch.cuda.empty_cache()
    return info


def run_parts(args) -> None:
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    os.environ["DIFFTUNE_BENCH_CHILD_TIMEOUT"] = str(args.part_timeout)
    info = device_info()
    (out / "device.json").write_text(json.dumps(info, indent=1))
    import gpu_families

    cfg = quick() if args.quick else realwidth(args.blocks, args.text_layers, args.resolution)
    deadline = args.deadline = time.monotonic() + args.budget
    with workdir_of(args) as wd:
        for part in args.parts.split(","):
            if time.monotonic() > deadline:
                (out / f"{part}.json").write_text(json.dumps({"skipped": "out of time"}))
                continue
            start = time.perf_counter()
            try:
                result = {"part_seconds": None, **{
                    "parity": lambda: part_parity(wd, args), "split": lambda: part_split(wd, args, cfg),
                    "fsdp": lambda: part_fsdp(wd, args, cfg), "demo": lambda: part_demo(wd, args),
                    "stage1": lambda: part_stage1(wd, args, cfg), "profile": lambda: part_profile(wd, args, cfg),
                    "mfu": lambda: gpu_families.part_mfu(wd, args, info.get("bf16_peak")),
                    "reference": lambda: gpu_families.part_reference(wd, args)}[part]()}
            except Exception as e:  # the next part still runs; the error is the part's result
                result = {"error": f"{type(e).__name__}: {e}"[-6000:], "traceback": traceback.format_exc()[-6000:]}
            result["part_seconds"] = time.perf_counter() - start
            (out / f"{part}.json").write_text(json.dumps(result, indent=1, default=str))
            print(f"{part}: {time.perf_counter() - start:.0f} s, "
                  f"{'error: ' + result['error'][:300] if 'error' in result else 'ok'}", flush=True)


# -- the doc ------------------------------------------------------------------------------------------

def _load(folders: list[Path], name: str) -> list[tuple[Path, dict]]:
    """Each folder's `<name>.json` that ran without error, with its folder."""
    found = []
    for folder in folders:
        path = folder / f"{name}.json"
        if path.is_file():
            result = json.loads(path.read_text())
            if "error" not in result and "skipped" not in result:
                found.append((folder, result))
    return found


def _gib(record: dict, key: str) -> float:
    return record.get(key, float("nan")) / 1024.0


def render(folders: list[Path]) -> str:
    """The doc's GPU section from one or more runs' folders (the first one's device line heads it)."""
    folders = [Path(f) for f in folders]
    dev = json.loads((folders[0] / "device.json").read_text())
    peak = dev.get("bf16_peak") or float("nan")
    parts = [f"Device: {dev.get('gpus', 0)} x {dev.get('gpu', 'no GPU')} ({dev.get('gpu_memory_gib', 0):.0f} GiB), "
             f"{dev['cpus']} CPU cores; torch {dev['torch']} (CUDA {dev['cuda']}), "
             + ", ".join(f"{k} {v}" for k, v in dev["versions"].items()) + f"; measured {dev['date']}, "
             f"{len(folders)} run(s) of `benchmarks/gpu.py` on fresh machines of that kind (results: "
             + ", ".join(f"`{f.relative_to(ROOT) if f.is_relative_to(ROOT) else f}`" for f in folders) + "). "
             f"An 8192^3 bf16 matrix product reached {dev.get('matmul_bf16_flops', 0) / 1e12:.0f} TFLOP/s there; "
             f"MFU is against the data sheet's dense bf16 peak, {peak / 1e12:.0f} TFLOP/s."]
    splits = _load(folders, "split")
    if splits:
        sp = splits[0][1]
        p, s, runs = sp["params"], sp["spec"], sp["runs"]
        step = {"one": sp["step_time_one_stage_s"], "stage2": sp["step_time_stage2_s"]}
        mfu = {k: sp["dit_model_flops_per_step"] / v / peak for k, v in step.items()}
        hfu = {k: sp["dit_hardware_flops_per_step"] / v / peak for k, v in step.items()}
        mem = {k: _gib(runs[k], "gpu_peak_allocated_mib") for k in ("one", "stage1", "stage2")}
        res = {k: _gib(runs[k], "gpu_peak_reserved_mib") for k in ("one", "stage1", "stage2")}
        parts.append(
            f"**Split against one stage at real width** (issue 6): {s['num_layers']} of Qwen-Image's 60 DiT blocks at "
            f"full width ({p['dit'] / 1e9:.2f}B parameters), a text encoder of Qwen2.5-VL-7B's widths with "
            f"{s['text_layers']} of its 28 layers ({p['text_encoder'] / 1e9:.2f}B, {p['text_encoder'] / p['dit']:.2f}x "
            f"the DiT; the real pair is 0.4x), the Qwen-Image VAE's architecture ({p['vae'] / 1e6:.0f}M); "
            f"{sp['images']} images at {sp['resolution']}x{sp['resolution']} ({sp['image_tokens']} image tokens, "
            f"{sp['text_tokens']:.0f} text tokens), repeat {sp['repeat']} = {sp['steps']} steps; {sp['dtype']}, LoRA "
            f"rank {sp['lora_rank']} on the 12 reference target modules, `--use_gradient_checkpointing`, batch 1. "
            f"Step time is the median after {sp['warmup_steps']} warm-up steps, the GPU synchronised at each "
            f"optimizer step. DiT model FLOPs count the base layers' forward and input gradients and attention "
            f"(backward 2x forward); HFU adds the checkpointed forward run again.")
        parts.append(table(["metric", "one stage", "stage 1", "stage 2", "stage 2 ÷ one stage"], [
            ["step time (s)", step["one"], "", step["stage2"], sp["step_time_ratio"]],
            ["DiT model FLOPs per step (TFLOP)", sp["dit_model_flops_per_step"] / 1e12, "",
             sp["dit_model_flops_per_step"] / 1e12, ""],
            ["MFU", mfu["one"], "", mfu["stage2"], ""],
            ["HFU", hfu["one"], "", hfu["stage2"], ""],
            ["peak GPU memory allocated (GiB)", mem["one"], mem["stage1"], mem["stage2"],
             ratio(mem["stage2"], mem["one"])],
            ["peak GPU memory reserved by torch (GiB)", res["one"], res["stage1"], res["stage2"],
             ratio(res["stage2"], res["one"])],
            ["whole run (s), model loading included", sp["total_time_one_stage_s"], sp["stage1_seconds"],
             runs["stage2"]["run_seconds"], ratio(sp["total_time_split_s"], sp["total_time_one_stage_s"])],
        ]))
        for folder, other in splits[1:]:
            parts.append(f"Run `{folder.name}`, the same measurement on another machine: step time "
                         f"{other['step_time_one_stage_s']:.3f} s one stage, {other['step_time_stage2_s']:.3f} s stage 2 "
                         f"(ratio {other['step_time_ratio']:.2f}); peak allocated "
                         f"{_gib(other['runs']['one'], 'gpu_peak_allocated_mib'):.1f} / "
                         f"{_gib(other['runs']['stage1'], 'gpu_peak_allocated_mib'):.1f} / "
                         f"{_gib(other['runs']['stage2'], 'gpu_peak_allocated_mib'):.1f} GiB (one stage / stage 1 / "
                         f"stage 2).")
    for folder, st in _load(folders, "stage1"):
        b1, b8 = st["batch1"], st["batch8"]
        parts.append(f"**Stage 1 batched on the GPU** (run `{folder.name}`): {st['images']} images at "
                     f"{st['resolution']}x{st['resolution']}, {st['dtype']}: one at a time "
                     f"{b1['samples_per_s']:.2f} samples/s with {_gib(b1, 'gpu_peak_allocated_mib'):.1f} GiB allocated at "
                     f"peak, 8 at a time {b8['samples_per_s']:.2f} samples/s with "
                     f"{_gib(b8, 'gpu_peak_allocated_mib'):.1f} GiB: {st['batched_speedup']:.2f}x the throughput for "
                     f"{ratio(b8['gpu_peak_allocated_mib'], b1['gpu_peak_allocated_mib']):.1f}x the memory.")
    for folder, pr in _load(folders, "profile"):
        c, n = pr["checkpointing"], pr["no_checkpointing"]
        gpu = {k: _profile_total(folder / f"profile{suffix}.txt") for k, suffix in (("c", ""), ("n", "_nockpt"))}
        parts.append(f"**Where a stage-2 step goes** (run `{folder.name}`, torch.profiler over 5 steps; tables in "
                     f"`profile.txt` and `profile_nockpt.txt` there): with gradient checkpointing a step took "
                     f"{c['step_time_s']:.3f} s and kept the GPU busy {gpu['c'] / 5:.3f} s of it; without it "
                     f"{n['step_time_s']:.3f} s, GPU busy {gpu['n'] / 5:.3f} s, "
                     f"{_gib(n, 'gpu_peak_allocated_mib'):.1f} GiB at peak against "
                     f"{_gib(c, 'gpu_peak_allocated_mib'):.1f} GiB.")
    for folder, fs in _load(folders, "fsdp"):
        rows = []
        labels = {"one": "1 process", "fsdp2": f"FSDP2, {fs['gpus']} process(es) (examples/accelerate/fsdp.yaml)",
                  "ddp": f"DDP, {fs['gpus']} processes"}
        for kind, record in fs["runs"].items():
            t = fs[f"step_time_{kind}_s"]
            rows.append([labels[kind], t, fs["dit_model_flops_per_sample"] * fs["gpus"] / t / peak,
                         _gib(record, "gpu_peak_allocated_mib"), _gib(record, "gpu_peak_reserved_mib"),
                         "—" if kind == "one" else f"{fs[f'max_diff_{kind}_vs_one']:.1e}"])
        parts.append(
            f"**Full training, FSDP2 against one process** (issue 26; run `{folder.name}`): `--trainable_models dit` on "
            f"the same {fs['spec']['num_layers']} real-width blocks ({fs['params_dit'] / 1e9:.2f}B parameters, "
            f"{fs['dtype']} weights, AdamW) from the split part's cache, gradient checkpointing, {fs['gpus']} GPU(s) x "
            f"batch 1 per step.")
        parts.append(table(["run", "step time (s)", "MFU", "peak GPU memory allocated (GiB, rank 0)",
                            "reserved (GiB)", "checkpoint's largest difference from 1 process"], rows))
    import gpu_families

    for folder, mfu in _load(folders, "mfu"):
        parts += [f"(run `{folder.name}`) " + p if i == 0 else p
                  for i, p in enumerate(gpu_families.render(mfu, None))]
    for folder, ref in _load(folders, "reference"):
        parts += [f"(run `{folder.name}`) " + p if i == 0 else p
                  for i, p in enumerate(gpu_families.render(None, ref))]
    for folder, pa in _load(folders, "parity"):
        parts.append(f"**Split equals one stage on the GPU** (run `{folder.name}`): the tests' tiny Qwen-Image in "
                     f"fp32, a LoRA trained {pa['steps']} steps one stage and split; the two LoRAs' largest difference "
                     f"is {pa['lora_max_diff']:.1e} (the CPU tests hold 1e-5).")
    for folder, dm in _load(folders, "demo"):
        sm = dm["summary"]
        parts.append(f"**`difftune demo` on the GPU machine** (run `{folder.name}`): exit 0 in {dm['wall_seconds']:.0f} s "
                     f"(stage 2: {sm['steps']} steps in {sm['stages']['stage2_train']['seconds']:.0f} s; its sampling "
                     f"runs on the CPU by design); star IoU {sm['metric']['before']:.3f} -> {sm['metric']['after']:.3f}, "
                     f"{sm['metric']['star_fraction_after']:.0%} of samples look like a star.")
    return "\n\n".join(parts)


def _profile_total(path: Path) -> float:
    """Seconds of GPU time in a profiler table's 'Self CUDA time total' line."""
    for line in path.read_text().splitlines():
        if line.startswith("Self CUDA time total:"):
            value = line.split(":", 1)[1].strip()
            scale = {"us": 1e-6, "ms": 1e-3, "s": 1.0}
            for unit in ("us", "ms", "s"):
                if value.endswith(unit):
                    return float(value[: -len(unit)]) * scale[unit]
    return float("nan")


def main(argv=None) -> None:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--out", default=None, help="where each part's JSON goes")
    p.add_argument("--render", nargs="+", default=None, help="folders of part JSONs (one per run): write the doc's GPU "
                                                                "section from them")
    p.add_argument("--parts", default=",".join(PARTS))
    p.add_argument("--blocks", type=int, default=8, help="real-width DiT blocks (Qwen-Image has 60)")
    p.add_argument("--text_layers", type=int, default=4, help="text-encoder layers (Qwen2.5-VL-7B has 28)")
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--dtype", default=None, help="--torch_dtype of the runs (default bfloat16; float32 with --quick)")
    p.add_argument("--images", type=int, default=None)
    p.add_argument("--repeat", type=int, default=None)
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--budget", type=float, default=1e9, help="seconds after which no further part starts")
    p.add_argument("--part_timeout", type=float, default=600, help="seconds a measured process may run")
    p.add_argument("--mfu_blocks", type=int, default=2, help="real-width blocks per family in the mfu and reference "
                                                             "parts")
    p.add_argument("--families", default=",".join(("qwen_image", "z_image", "flux", "wan", "ace_step", "ltx2")),
                   help="the mfu part's families, in this order (past --budget the rest are skipped)")
    p.add_argument("--ds-python", dest="ds_python", default=None, help="reference part: python of a venv with "
                                                                       "DiffSynth-Studio's diffsynth package")
    p.add_argument("--diffsynth_src", default=None, help="reference part: a DiffSynth-Studio checkout to import "
                                                         "diffsynth from (with this python)")
    args = p.parse_args(argv)
    if args.render:
        update_doc(None if args.no_doc else Path(args.doc or ROOT / "docs" / "benchmarks.md"), "gpu",
                   render(args.render))
        return
    args.images = args.images or (2 if args.quick else 8)
    args.dtype = args.dtype or ("float32" if args.quick else "bfloat16")
    args.repeat = args.repeat or (2 if args.quick else 3)
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 4)
    args.threads = max(args.threads, 1)
    if args.out is None:
        raise SystemExit("--out DIR is needed (each part's JSON goes there)")
    run_parts(args)


def _child(payload: dict) -> dict:
    if payload["kind"] == "flops":
        from gpu_families import flops_child

        return flops_child(payload)
    return _profile_child(payload)


if __name__ == "__main__":
    if "--child" in sys.argv:  # a measured child process (see part_profile, gpu_families.counted_run)
        from common import child_main

        child_main(_child)
    else:
        main()
