"""Runs the phase-1 checks of FSDP2 on 2 CPU processes (gloo) and prints/writes the figures.

    PYTHONPATH=src .venv/bin/python prototypes/fsdp/run_checks.py /tmp/fsdp_ws [check ...]

Checks (each launches `difftune train` through prototypes/fsdp/launch.py, one multi-process run at a time):
  full       full training, one stage: 2 FSDP2 processes (batch 1) == 1 process (accumulation 2), <= 1e-5;
             the checkpoint is one consolidated safetensors file with the one-process keys; memory figures
  resume     the FSDP2 run killed with SIGKILL after a saved state, resumed on 2 processes == uninterrupted (<= 1e-6)
  reshard    the same killed state resumed on 1 unsharded process (accumulation 2, --force_resume) (<= 1e-5)
  lora       LoRA on the DiT under FSDP2 (frozen base + trainable LoRA in one unit) == 1 process
  stage2     split training's stage 2 from a cache, full training, --use_gradient_checkpointing and
             --max_grad_norm: 2 FSDP2 processes == 1 process
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
FSDP_CONFIG = ROOT / "examples" / "accelerate" / "fsdp.yaml"
LORA_TARGETS = "to_q,to_k,to_v,add_q_proj,add_k_proj,add_v_proj,to_out.0,to_add_out,img_mlp.net.2,img_mod.1," \
               "txt_mlp.net.2,txt_mod.1"


def env(extra=None) -> dict:
    keep = {k: v for k, v in os.environ.items() if not k.startswith(("ACCELERATE_", "FSDP_"))
            and k not in {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}}
    return {**keep, "OMP_NUM_THREADS": "1", "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": str(ROOT / "src"),
            "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1", "TOKENIZERS_PARALLELISM": "false",
            **(extra or {})}


def two(*argv) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", str(FSDP_CONFIG),
            "--num_processes", "2", "--mixed_precision", "no", "--dynamo_backend", "no", "--main_process_port", "0",
            str(HERE / "launch.py"), *map(str, argv)]


def one(*argv) -> list[str]:
    return [sys.executable, str(HERE / "launch.py"), *map(str, argv)]


def run(cmd, ws: Path, extra_env=None) -> str:
    started = time.perf_counter()
    proc = subprocess.run(cmd, env=env({"HF_HOME": str(ws / "hf_home"), **(extra_env or {})}), capture_output=True,
                          text=True, timeout=900, cwd=ws)
    if proc.returncode != 0:
        raise SystemExit(f"FAILED: {' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    print(f"  ran in {time.perf_counter() - started:.0f}s: {' '.join(cmd[-12:])}", flush=True)
    return proc.stdout


def workspace(ws: Path) -> dict:
    from PIL import Image

    from difftune.testing import tiny_qwen_image_paths, write_tiny_qwen_image

    (ws / "hf_home").mkdir(parents=True, exist_ok=True)
    if not (ws / "tiny" / "model_index.json").exists():
        write_tiny_qwen_image(ws / "tiny")
    data = ws / "data"
    data.mkdir(exist_ok=True)
    rows = ["image,prompt"]
    for i in range(4):
        Image.effect_noise((32, 32), 30 + 10 * i).convert("RGB").save(data / f"img{i}.png")
        rows.append(f'img{i}.png,"a picture number {i}"')
    (data / "metadata.csv").write_text("\n".join(rows) + "\n")
    paths = tiny_qwen_image_paths(ws / "tiny")
    models = json.dumps([paths[c] if len(paths[c]) > 1 else paths[c][0] for c in ("transformer", "text_encoder", "vae")])
    return {"models": models, "data": data, "meta": data / "metadata.csv", "dit": paths["transformer"]}


def common(w, *extra):
    return ["--model_paths", w["models"], "--torch_dtype", "float32", "--max_pixels", 1024, "--seed", 3,
            "--learning_rate", 1e-3, "--num_epochs", 2, "--dataset_repeat", 2, "--no_progress", *extra]


def raw(w):
    return ["--dataset_base_path", w["data"], "--dataset_metadata_path", w["meta"]]


def max_diff(a_path: Path, b_path: Path) -> tuple[float, int]:
    from safetensors.torch import load_file

    a, b = load_file(str(a_path)), load_file(str(b_path))
    assert a.keys() == b.keys(), (sorted(a.keys() ^ b.keys())[:5])
    return max((a[k] - b[k]).abs().max().item() for k in a), len(a)


def moved(trained: Path, w) -> float:
    """How far training moved the weights from the release files (so that equality means something)."""
    from safetensors.torch import load_file

    base = {}
    for f in w["dit"]:
        base.update(load_file(f))
    t = load_file(str(trained))
    return max((t[k] - base[k]).abs().max().item() for k in t if k in base)


def memory(folder: Path) -> dict:
    return {p.stem: json.loads(p.read_text()) for p in sorted(folder.glob("rank-*.json"))}


def check_full(ws, w, results):
    full = ["--task", "sft", *raw(w), *common(w), "--trainable_models", "dit", "--batch_size", 1]
    out = run(two(*full, "--output_path", ws / "full2", "--save_state_steps", 3),
              ws, {"PROTO_MEMORY_DIR": str(ws / "mem2")})
    engine_line = next(line for line in out.splitlines() if line.startswith("engine:"))
    run(one(*full, "--gradient_accumulation_steps", 2, "--output_path", ws / "full1"), ws,
        {"PROTO_MEMORY_DIR": str(ws / "mem1")})
    diff, n = max_diff(ws / "full1" / "epoch-1.safetensors", ws / "full2" / "epoch-1.safetensors")
    files = sorted(p.name for p in (ws / "full2").glob("*.safetensors"))
    last = max((ws / "full2" / "state").glob("step-*"), key=lambda p: int(p.name.split("-")[1]))
    shards = [f"{last.name}/{p.relative_to(last)}" for p in sorted(last.rglob("*")) if p.is_file()]
    m1, m2 = memory(ws / "mem1"), memory(ws / "mem2")
    per1 = m1["rank-0"]["total"]
    per2 = max(m["total"] for m in m2.values())
    results["full"] = {"engine_line": engine_line, "max_diff_1proc_vs_2proc": diff, "tensors": n,
                       "moved_from_initial": moved(ws / "full2" / "epoch-1.safetensors", w), "checkpoints": files,
                       "state_shards": shards, "memory_1proc": m1, "memory_2proc": m2,
                       "params_plus_optimizer_ratio_2proc_over_1proc": per2 / per1}
    assert diff <= 1e-5, diff


def kill_after_state(cmd, ws, state_root: Path, min_step: int) -> int:
    proc = subprocess.Popen(cmd, env=env({"HF_HOME": str(ws / "hf_home")}), cwd=ws, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + 600
    try:
        while time.time() < deadline:
            steps = [int(p.name.split("-")[1]) for p in state_root.glob("step-*")] if state_root.exists() else []
            if steps and max(steps) >= min_step:
                kill_tree(proc)
                return max(steps)
            if proc.poll() is not None:
                raise SystemExit(f"the run ended before it was killed: {proc.stderr.read().decode()[-3000:]}")
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    raise SystemExit("no state saved in time")


def kill_tree(proc) -> None:
    """SIGKILL the launcher and every training process at once (torch's elastic agent starts each worker in a
    session of its own, so killing the launcher's process group would leave them running)."""
    import psutil

    tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    for p in tree:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(tree, timeout=30)


def check_resume(ws, w, results, reshard: bool):
    full = ["--task", "sft", *raw(w), *common(w), "--trainable_models", "dit", "--batch_size", 1,
            "--save_state_steps", 3]
    if not (ws / "full2" / "epoch-1.safetensors").exists():
        run(two(*full, "--output_path", ws / "full2"), ws)
    killed = ws / ("killed-reshard" if reshard else "killed")
    at = kill_after_state(two(*full, "--output_path", killed), ws, killed / "state", min_step=3)
    left = sorted(p.name for p in (killed / "state").iterdir())
    if reshard:  # one unsharded process, the same samples per step through accumulation
        out = run(one(*full, "--gradient_accumulation_steps", 2, "--output_path", killed, "--resume_from_checkpoint",
                      "latest", "--force_resume"), ws)
    else:
        out = run(two(*full, "--output_path", killed, "--resume_from_checkpoint", "latest"), ws)
    resumed = next(line for line in out.splitlines() if line.startswith("resumed from"))
    diff, _ = max_diff(ws / "full2" / "epoch-1.safetensors", killed / "epoch-1.safetensors")
    results["reshard" if reshard else "resume"] = {"killed_after_state_step": at, "state_dir_after_kill": left,
                                                   "resumed": resumed, "max_diff_vs_uninterrupted": diff}
    assert at < 8 and diff <= (1e-5 if reshard else 1e-6), diff


def check_lora(ws, w, results):
    lora = ["--task", "sft", *raw(w), *common(w), "--lora_base_model", "dit", "--lora_target_modules", LORA_TARGETS,
            "--lora_rank", 4, "--batch_size", 1]
    out = run(two(*lora, "--output_path", ws / "lora2", "--save_state_steps", 4), ws)
    run(one(*lora, "--gradient_accumulation_steps", 2, "--output_path", ws / "lora1"), ws)
    diff, n = max_diff(ws / "lora1" / "epoch-1.safetensors", ws / "lora2" / "epoch-1.safetensors")
    from safetensors.torch import load_file

    b = load_file(str(ws / "lora2" / "epoch-1.safetensors"))
    results["lora"] = {"engine_line": next(line for line in out.splitlines() if line.startswith("engine:")),
                       "max_diff_1proc_vs_2proc": diff, "tensors": n,
                       "max_lora_B": max(v.abs().max().item() for k, v in b.items() if ".lora_B." in k)}
    assert diff <= 1e-5, diff


def check_stage2(ws, w, results):
    cache = ws / "cache"
    if not (cache / "manifest.json").exists():
        run(one("--task", "sft:data_process", *raw(w), *common(w), "--trainable_models", "dit", "--output_path",
                cache), ws)
    s2 = ["--task", "sft:train", "--dataset_base_path", cache, *common(w), "--trainable_models", "dit",
          "--batch_size", 1, "--use_gradient_checkpointing", "--max_grad_norm", 0.05]
    out = run(two(*s2, "--output_path", ws / "s2_2"), ws)
    run(one(*s2, "--gradient_accumulation_steps", 2, "--output_path", ws / "s2_1"), ws)
    diff, n = max_diff(ws / "s2_1" / "epoch-1.safetensors", ws / "s2_2" / "epoch-1.safetensors")
    # the clipping bites (unclipped differs), and the loop's own clip call (parameters listed before prepare)
    # clips nothing under FSDP2
    unclipped = [a for a in s2 if a not in ("--max_grad_norm", 0.05)]
    run(one(*unclipped, "--gradient_accumulation_steps", 2, "--output_path", ws / "s2_1_noclip"), ws)
    proc = subprocess.run(two(*s2, "--output_path", ws / "s2_2_loopclip"), capture_output=True, text=True,
                          env=env({"HF_HOME": str(ws / "hf_home"), "PROTO_NO_CLIP_FIX": "1"}), cwd=ws, timeout=900)
    loop_clip = "ran" if proc.returncode == 0 else \
        next((line for line in proc.stderr.splitlines() if "Error:" in line), proc.stderr[-300:])
    results["stage2"] = {"engine_line": next(line for line in out.splitlines() if line.startswith("engine:")),
                         "max_diff_1proc_vs_2proc": diff, "tensors": n,
                         "moved_from_initial": moved(ws / "s2_2" / "epoch-1.safetensors", w),
                         "clipped_vs_unclipped_1proc": max_diff(ws / "s2_1" / "epoch-1.safetensors",
                                                                ws / "s2_1_noclip" / "epoch-1.safetensors")[0],
                         "loop_clip_call_unfixed": loop_clip}
    assert diff <= 1e-5, diff


def main():
    ws = Path(sys.argv[1]).resolve()
    wanted = sys.argv[2:] or ["full", "resume", "reshard", "lora", "stage2"]
    w = workspace(ws)
    results_file = ws / "results.json"
    results = json.loads(results_file.read_text()) if results_file.exists() else {}
    for name in wanted:
        print(f"check {name}", flush=True)
        try:
            {"full": check_full, "lora": check_lora, "stage2": check_stage2,
             "resume": lambda *a: check_resume(*a, reshard=False),
             "reshard": lambda *a: check_resume(*a, reshard=True)}[name](ws, w, results)
        finally:
            results_file.write_text(json.dumps(results, indent=1))
        print(json.dumps(results.get(name), indent=1), flush=True)


if __name__ == "__main__":
    main()
