"""The `train` command as a recipe: configuration -> setup -> [stage 1] -> fit (training, with its checkpoints)
-> report. Each step is a plain function; the loop (`loop.py`) only loops.

Tasks: `sft` / `direct_distill` (or a family's own loss) train in one stage; `<task>:data_process` runs stage 1
and writes the cache; `<task>:train` trains from a cache; `<task>:split` does both in one command, freeing the
stage-1 models before stage 2.
"""

from __future__ import annotations

from ..errors import UserError
from .config import RunConfig
from .accelerator import main_process_log, make_accelerator
from .setup import ensure_writable, setup
from .stages import check_outputs, fit, from_cache, stage1


def run(args) -> dict:
    """Run the command (a RunConfig, or the parsed flags); with SIGTERM / SIGINT during training it saves, and the
    summary says `stopped`. A distributed run ends with every process at a barrier, its process group destroyed."""
    from .engines import finish_distributed

    summary = _run(args)
    finish_distributed()
    return summary


def _run(args) -> dict:
    from .run_lock import output_lock
    from .signals import StopSignals

    from .module import check_lora_and_full

    config = RunConfig.from_namespace(args)
    task = config.task_spec
    check_lora_and_full(config.trainable_models, config.lora_base_model)
    if task.stage != "data_process":
        from .trackers import requested

        requested(config)  # a tracker's package missing: said now, not after stage 1
    ensure_writable(config.output_path)
    accelerator = make_accelerator(config, None if task.stage == "data_process" else config.output_path)
    log = main_process_log(accelerator)
    with StopSignals(verbose=accelerator.is_main_process) as stop, \
            output_lock(config.output_path, enabled=accelerator.is_main_process,
                        cache_only=task.stage == "data_process", log=log):
        the_run = setup(config, accelerator, log)                             # family, models, features, split
        check_outputs(the_run)
        if config.train_experts:
            from .experts import train_experts

            return train_experts(the_run, stop)
        if config.expert_boundary is not None:
            raise UserError("--expert_boundary: only with --train_experts both (one expert per run takes "
                            "--max_timestep_boundary / --min_timestep_boundary)")
        summary = {}
        if task.stage in ("data_process", "split"):
            summary["stage1"] = stage1(the_run)                                  # into the cache
            if task.stage == "data_process":
                return summary["stage1"]
            the_run = from_cache(the_run, summary["stage1"]["cache"])
        return {**fit(the_run, from_cache=task.stage in ("train", "split"), stop=stop), **summary}
