"""`accelerate launch ... -m difftune.train` on CPU processes (gloo), as a user types it with a GPU config and the
overrides a machine without GPUs needs (`--num_processes`, `--mixed_precision no`): for the sharded-engine tests."""

from __future__ import annotations

import hashlib
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "examples" / "accelerate"
DIST_VARIABLES = {"RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}


def free_port() -> int:
    # a fixed free port: DeepSpeed's own rendezvous waits forever on port 0
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def command(config: Path, *argv, processes: int = 2) -> list[str]:
    return [sys.executable, "-m", "accelerate.commands.accelerate_cli", "launch", "--config_file", str(config),
            "--num_processes", str(processes), "--mixed_precision", "no", "--dynamo_backend", "no",
            "--main_process_port", str(free_port()), "-m", "difftune.train", *map(str, argv)]


# the DeepSpeed launches' workers skip the CPU-only shared-memory op DeepSpeed compiles and training never uses
DEEPSPEED_SITE = Path(__file__).resolve().parent / "deepspeed_site"


def environment(root: Path, config: Path | None = None) -> dict:
    inherited = {k: v for k, v in os.environ.items()  # nothing of an earlier (in-process) distributed run
                 if not k.startswith(("ACCELERATE_", "FSDP_")) and k not in DIST_VARIABLES}
    src = str(ROOT / "src")
    site = str(DEEPSPEED_SITE) if config is not None and "DEEPSPEED" in config.read_text() else None
    path = os.pathsep.join(p for p in (src, site, inherited.get("PYTHONPATH")) if p)
    return {**inherited, "PYTHONPATH": path, "TORCH_EXTENSIONS_DIR": extensions_dir(), "OMP_NUM_THREADS": "1",
            "CUDA_VISIBLE_DEVICES": "", "HF_HOME": str(root / "hf_home"), "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_DISABLE_PROGRESS_BARS": "1",
            "TOKENIZERS_PARALLELISM": "false"}


def extensions_dir() -> str:
    """Torch's JIT-built ops (DeepSpeed's CPU Adam) cached per Python environment: two environments sharing torch's
    default folder rebuild the op (minutes) each time the other one ran, its build commands naming other paths."""
    base = os.environ.get("TORCH_EXTENSIONS_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "torch_extensions")
    tag = hashlib.sha1(sys.prefix.encode()).hexdigest()[:10]
    folder = base if base.rstrip(os.sep).endswith(tag) else os.path.join(base, f"env-{tag}")
    # A build killed midway (a timed-out test, a stopped run) leaves torch's `lock` file behind, and every later build
    # waits on it forever. A build takes a minute or two: a lock untouched for ten minutes has no builder.
    for lock in Path(folder).glob("*/lock"):
        try:
            if time.time() - lock.stat().st_mtime > 600:
                lock.unlink()
        except OSError:
            pass
    return folder


def launch(root: Path, config: Path, *argv, processes: int = 2, timeout: int = 400) -> subprocess.CompletedProcess:
    """Run it to the end; returns the finished process (stdout holds the main process's log)."""
    (root / "hf_home").mkdir(exist_ok=True)  # no user accelerate config can leak into the launch
    cmd = command(config, *argv, processes=processes)
    proc = subprocess.run(cmd, env=environment(root, config), capture_output=True, text=True, timeout=timeout,
                          cwd=root)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def kill_after_state(root: Path, config: Path, *argv, state_root: Path, min_step: int, processes: int = 2,
                     timeout: int = 400) -> int:
    """Start the run, SIGKILL the launcher and every training process as soon as a state of step >= min_step is
    saved; returns the newest saved step."""
    import psutil

    (root / "hf_home").mkdir(exist_ok=True)
    proc = subprocess.Popen(command(config, *argv, processes=processes), env=environment(root, config), cwd=root,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, start_new_session=True)
    deadline = time.time() + timeout
    try:
        while time.time() < deadline:
            steps = [int(p.name.split("-")[1]) for p in state_root.glob("step-*")] if state_root.exists() else []
            if steps and max(steps) >= min_step:
                kill_tree(proc)
                return max(steps)
            if proc.poll() is not None:
                raise AssertionError(f"the run ended before it was killed: {proc.stderr.read().decode()[-3000:]}")
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            kill_tree(proc)
    raise AssertionError("no training state was saved in time")


def kill_tree(proc) -> None:
    """SIGKILL the launcher and its workers at once (torch's elastic agent starts each worker in a session of its
    own, so the launcher's process group does not reach them)."""
    import psutil

    try:
        tree = [psutil.Process(proc.pid), *psutil.Process(proc.pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        tree = []
    for p in tree:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass
    proc.wait()
    psutil.wait_procs(tree, timeout=30)


def max_diff(a_path: Path, b_path: Path) -> float:
    from safetensors.torch import load_file

    a, b = load_file(str(a_path)), load_file(str(b_path))
    assert a.keys() == b.keys(), sorted(a.keys() ^ b.keys())[:5]
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def engine_line(stdout: str) -> str:
    return next(line for line in stdout.splitlines() if line.startswith("engine:"))
