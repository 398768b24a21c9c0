"""Sharding's memory: the parameters, gradients and optimizer state each process holds in full training of the DiT,
one process against 2 processes under DDP and under FSDP2 (examples/accelerate/fsdp.yaml), on CPU processes (gloo).

Every run is `difftune train --task sft:train --trainable_models dit` from one stage-1 cache, launched as a user
launches it (`accelerate launch --config_file ... -m difftune.train`, 2 processes x batch 1 against 1 process x
accumulation 2, so each step sees the same samples). A global optimizer-step hook in each training process reads
what that process holds right after every optimizer step (a DTensor counts its local shard only): the trainable
parameters, their gradients, and the optimizer's tensors; the largest sum, the process's peak RSS and its step
times are recorded.

    .venv/bin/python benchmarks/sharded_memory.py            # the proportional model (~1 min here)
    .venv/bin/python benchmarks/sharded_memory.py --quick    # smoke run on the tests' tiny model (no DDP run)
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (ROOT, base_parser, emit, fresh, machine, machine_line, prepare, proportional, quick,  # noqa: E402
                    ratio, resolve_doc, run_difftune, table, update_doc, workdir_of)

CONFIGS = ROOT / "examples" / "accelerate"
MIB = 1024.0 * 1024.0


def local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if hasattr(t, "to_local") else t
        total += local.numel() * local.element_size()
    return total


def child(payload: dict) -> None:
    """In each training process: hook every optimizer step, train, write rank-<i>.json."""
    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    peak = {"params": 0, "grads": 0, "optimizer": 0, "total": 0}
    stamps: list[float] = []

    def measure(optimizer, *_):
        params = [p for g in optimizer.param_groups for p in g["params"]]
        moments = [v for s in optimizer.state.values() for v in s.values()
                   if isinstance(v, torch.Tensor) and v.dim() > 0]
        now = {"params": local_bytes(params), "grads": local_bytes(p.grad for p in params if p.grad is not None),
               "optimizer": local_bytes(moments)}
        now["total"] = now["params"] + now["grads"] + now["optimizer"]
        if now["total"] > peak["total"]:
            peak.update(now)
        stamps.append(time.perf_counter())

    register_optimizer_step_post_hook(measure)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from difftune.cli.main import main

    code = main(["train", *payload["argv"]])
    rank = int(os.environ.get("RANK", "0"))
    with open("/proc/self/status") as f:
        hwm = next(int(line.split()[1]) for line in f if line.startswith("VmHWM:"))
    intervals = [b - a for a, b in zip(stamps, stamps[1:])][payload["warmup"]:]
    out = Path(payload["out"])
    out.mkdir(parents=True, exist_ok=True)
    (out / f"rank-{rank}.json").write_text(json.dumps({**peak, "vmhwm_kb": hwm, "steps": len(stamps),
                                                       "step_time": statistics.median(intervals) if intervals
                                                       else None}))
    from difftune.training.engines import exit_launched_process

    exit_launched_process(code)
    sys.exit(code)


def run(kind: str, argv: list[str], out: Path, threads: int, warmup: int) -> list[dict]:
    """One training run (`one`, `ddp` or `fsdp2`); each process's record."""
    fresh(out)
    payload = json.dumps({"argv": argv, "out": str(out / "memory"), "warmup": warmup})
    script = [str(Path(__file__).resolve()), "--child", payload]
    if kind == "one":
        cmd = [sys.executable, *script]
    else:
        config = CONFIGS / ("fsdp.yaml" if kind == "fsdp2" else "multi_gpu_ddp.yaml")
        cmd = [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", str(config),
               "--num_processes", "2", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port",
               "0", *script]
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))}
    env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads), CUDA_VISIBLE_DEVICES="",
               TOKENIZERS_PARALLELISM="false", TRANSFORMERS_VERBOSITY="error", HF_HUB_DISABLE_PROGRESS_BARS="1",
               HF_HOME=str(out.parent / "hf_home"),
               PYTHONPATH=os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    (out.parent / "hf_home").mkdir(exist_ok=True)
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=1800, cwd=str(ROOT))
    if proc.returncode != 0:
        raise RuntimeError(f"{kind} run failed (exit {proc.returncode})\n{proc.stdout[-1500:]}\n{proc.stderr[-3000:]}")
    engine = next((line for line in proc.stdout.splitlines() if line.startswith("engine:")), "")
    records = [json.loads(p.read_text()) for p in sorted((out / "memory").glob("rank-*.json"))]
    for r in records:
        r["engine"] = engine
    return records


def max_diff(a: Path, b: Path) -> float:
    from safetensors.torch import load_file

    x, y = load_file(str(a)), load_file(str(b))
    return max((x[k] - y[k]).abs().max().item() for k in x)


def main(argv=None) -> dict:
    p = base_parser(__doc__.splitlines()[0])
    p.add_argument("--images", type=int, default=None)
    args = p.parse_args(argv)
    cfg = quick() if args.quick else proportional()
    n = args.images or (2 if args.quick else 8)
    warmup = 1 if args.quick else 2
    info = machine(args.threads)
    with workdir_of(args) as wd:
        ws = prepare(wd, cfg, n)
        cache = wd / "cache-sharded"
        res = str(cfg.resolution)
        base = ["--model_paths", ws.model_paths(("transformer", "text_encoder", "vae")), "--height", res, "--width",
                res, "--torch_dtype", "float32", "--learning_rate", "1e-5", "--trainable_models", "dit", "--seed", "0",
                "--no_progress", "--enable_tensorboard_log", "false"]
        fresh(cache)
        run_difftune(["--task", "sft:data_process", "--dataset_base_path", str(ws.data), "--dataset_metadata_path",
                      str(ws.metadata), "--output_path", str(cache), *base], isolated=not args.quick,
                     threads=args.threads)
        train = ["--task", "sft:train", "--dataset_base_path", str(cache), *base, "--batch_size", "1",
                 "--num_epochs", "1", "--dataset_repeat", "2"]
        runs = {"one": run("one", [*train, "--gradient_accumulation_steps", "2", "--output_path", str(wd / "one")],
                           wd / "one", args.threads, warmup)}
        kinds = ["fsdp2"] if args.quick else ["ddp", "fsdp2"]
        for kind in kinds:
            unused = ["--find_unused_parameters"] if kind == "ddp" else []  # the last block's text branch: no grad
            runs[kind] = run(kind, [*train, *unused, "--output_path", str(wd / kind)], wd / kind, args.threads,
                             warmup)
        diff = max_diff(wd / "one" / "epoch-0.safetensors", wd / "fsdp2" / "epoch-0.safetensors")

    one = runs["one"][0]
    result = {"benchmark": "sharded_memory", "config": cfg.name, "images": n, "machine": info,
              "max_diff_fsdp2_vs_one": diff}
    rows = []
    labels = {"one": "1 process (accumulation 2)", "ddp": "DDP, 2 processes", "fsdp2": "FSDP2, 2 processes"}
    for kind, records in runs.items():
        worst = max(records, key=lambda r: r["total"])
        state = worst["params"] + worst["optimizer"]
        result[f"{kind}_per_process"] = records
        result[f"params_plus_optimizer_ratio_{kind}"] = ratio(state, one["params"] + one["optimizer"])
        result[f"state_ratio_{kind}"] = ratio(worst["total"], one["total"])
        result[f"peak_rss_ratio_{kind}"] = ratio(max(r["vmhwm_kb"] for r in records), one["vmhwm_kb"])
        rows.append([labels[kind], worst["params"] / MIB, worst["grads"] / MIB, worst["optimizer"] / MIB,
                     state / MIB, result[f"params_plus_optimizer_ratio_{kind}"],
                     max(r["vmhwm_kb"] for r in records) / 1024.0,
                     max(r["step_time"] or 0.0 for r in records)])
    result["engine_line_fsdp2"] = runs["fsdp2"][0]["engine"]
    body = "\n\n".join([
        f"Config `{cfg.name}`: full training of the DiT ({one['params'] / 4 / 1e6:.1f}M fp32 parameters) in stage 2 "
        f"from a cache of {n} images at {cfg.resolution}x{cfg.resolution}, 2 x {n} samples, 2 per optimizer step; "
        f"AdamW. Per process, right after an optimizer step (the largest over the run); a DTensor counts its local "
        f"shard. FSDP2's checkpoint equals the one-process run's to {diff:.1e}.",
        table(["run", "parameters (MiB)", "gradients (MiB)", "AdamW state (MiB)", "parameters + AdamW (MiB)",
               "÷ 1 process", "peak RSS (MiB)", "step time (s)"], rows),
        f"Log line: `{result['engine_line_fsdp2']}`",
        machine_line(info)])
    update_doc(resolve_doc(args), "sharded_memory", body)
    emit(result)
    return result


if __name__ == "__main__":
    if "--child" in sys.argv:
        child(json.loads(sys.argv[sys.argv.index("--child") + 1]))
    else:
        main()
