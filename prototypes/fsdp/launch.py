"""Prototype entry point: `difftune train` under FSDP2, with the engine pieces of this folder put in from outside
(src/difftune/training is being restructured on main, so nothing there is edited; each patch below names the
function the integration changes).

    accelerate launch --config_file examples/accelerate/fsdp2.yaml --num_processes 2 --mixed_precision no \
        prototypes/fsdp/launch.py <difftune train flags>

Environment: PROTO_MEMORY_DIR=<dir> writes rank-<r>.json (the largest parameter + optimizer bytes this process
held after an optimizer step, and its peak RSS); PROTO_SHARDED_STATE=1 writes the sharded (DCP) state also when
the run is not sharded (one process), as the integration would for every engine; PROTO_NO_CLIP_FIX=1 leaves
the loop's clip_grad_norm_ call as it is (the parameters listed before prepare).
"""

from __future__ import annotations

import atexit
import json
import os
import resource
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import torch  # noqa: E402

import engine  # noqa: E402
import sharded_state  # noqa: E402


def install() -> None:
    from difftune.training import builders, recipe, state

    engine.deepspeed_on_cpu()

    original_make = builders.make_accelerator

    def make_accelerator(args, project_dir):  # -> builders.make_accelerator
        accelerator = original_make(args, project_dir)
        engine.fsdp_on_cpu(accelerator)
        _wrap_prepare(accelerator)
        return accelerator

    builders.make_accelerator = recipe.make_accelerator = make_accelerator

    original_save, original_load = state.save_training_state, state.load_training_state

    def save_training_state(accelerator, module, optimizer, schedule, position, settings, output_path, keep=2):
        if engine.is_fsdp2(accelerator) or os.environ.get("PROTO_SHARDED_STATE") == "1":
            return sharded_state.save_sharded_state(accelerator, module, optimizer, schedule, position, settings,
                                                    output_path, keep=keep)
        return original_save(accelerator, module, optimizer, schedule, position, settings, output_path, keep=keep)

    def load_training_state(path, accelerator, module, optimizer, schedule, settings, force=False):
        if sharded_state.is_sharded_state(path):
            return sharded_state.load_sharded_state(path, accelerator, module, optimizer, schedule, settings, force)
        return original_load(path, accelerator, module, optimizer, schedule, settings, force=force)

    state.save_training_state, state.load_training_state = save_training_state, load_training_state


def _wrap_prepare(accelerator) -> None:
    """-> loop.train: configure the wrap before prepare, log the engine, clip the prepared parameters."""
    original_prepare = accelerator.prepare

    def prepare(*objects):
        module = next((o for o in objects if isinstance(o, torch.nn.Module)), None)
        chosen = None
        if engine.is_fsdp2(accelerator) and hasattr(module, "pipe"):
            chosen = engine.configure_fsdp(accelerator, module)
        prepared = original_prepare(*objects)
        if module is not None:
            if accelerator.is_main_process:
                print(engine.engine_line(accelerator, chosen), flush=True)
            model = next(o for o in prepared if isinstance(o, torch.nn.Module))
            optimizer = next((o for o in prepared if isinstance(o, torch.optim.Optimizer)), None)
            if os.environ.get("PROTO_NO_CLIP_FIX") != "1":  # to show what the loop does without it
                _clip_prepared(accelerator, model)
            if optimizer is not None and os.environ.get("PROTO_MEMORY_DIR"):
                _track_memory(accelerator, model, optimizer)
        return prepared

    accelerator.prepare = prepare


def _clip_prepared(accelerator, model) -> None:
    # The loop hands clip_grad_norm_ the parameters it listed before prepare; FSDP2 has replaced them.
    original = accelerator.clip_grad_norm_

    def clip_grad_norm_(parameters, max_norm, norm_type=2):
        return original(engine.trainable_after_prepare(model), max_norm, norm_type)

    accelerator.clip_grad_norm_ = clip_grad_norm_


def _track_memory(accelerator, model, optimizer) -> None:
    peak = {"params": 0, "optimizer": 0, "total": 0}
    step = optimizer.step

    def measured_step(*a, **k):
        out = step(*a, **k)
        now = engine.state_bytes(model, optimizer)
        if now["params"] + now["optimizer"] > peak["total"]:
            peak.update(now, total=now["params"] + now["optimizer"])
        return out

    optimizer.step = measured_step

    def write():
        folder = Path(os.environ["PROTO_MEMORY_DIR"])
        folder.mkdir(parents=True, exist_ok=True)
        rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
        (folder / f"rank-{accelerator.process_index}.json").write_text(
            json.dumps({**peak, "world_size": accelerator.num_processes, "peak_rss": rss}))

    atexit.register(write)


if __name__ == "__main__":
    install()
    from difftune.cli.main import main

    sys.exit(main(["train", *sys.argv[1:]]))
