"""The run's accelerate `Accelerator`, built from its flags for the engine `accelerate launch` chose (`engines.py`
says what each engine needs), and the process-global accelerate state that several trainings in one process reset
between runs."""

from __future__ import annotations

import os

from ..errors import UserError
from .config import RunConfig
from .engines import accelerator_arguments, after_accelerator


def reset_accelerate_state() -> None:
    """Forget accelerate's process-global state, so the next Accelerator in this process starts clean (as a
    separate command would): for running several trainings in one process (the demo, tests, benchmarks)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def make_accelerator(config: RunConfig, project_dir: str | None):
    from accelerate import Accelerator, DistributedDataParallelKwargs
    from accelerate.utils import ProjectConfiguration

    mixed = config.mixed_precision
    if mixed is None:
        mixed = "bf16" if config.torch_dtype == "bfloat16" else "fp16" if config.torch_dtype == "float16" else "no"
    log_with = []
    if project_dir and config.enable_tensorboard_log:
        log_with.append("tensorboard")
    project = ProjectConfiguration(project_dir=project_dir, logging_dir=os.path.join(project_dir, "logs")) \
        if project_dir else None
    engine = accelerator_arguments()  # cpu=True without CUDA: gloo DDP under `accelerate launch --multi_gpu`
    accelerator = Accelerator(
        cpu=engine["cpu"], gradient_accumulation_steps=config.gradient_accumulation_steps, mixed_precision=mixed,
        log_with=log_with or None, project_config=project,
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=bool(config.find_unused_parameters)),
                         *engine["kwargs_handlers"]],
    )
    after_accelerator(accelerator)  # FSDP2 on CPU processes; FSDP1 refused
    # A DeepSpeed accelerate config's gradient_accumulation_steps arrives through the environment and beats
    # the argument above; the sampler and step counts follow the flag, so a mismatch would go wrong silently.
    if accelerator.gradient_accumulation_steps != config.gradient_accumulation_steps:
        raise UserError(f"the accelerate config sets gradient_accumulation_steps to "
                        f"{accelerator.gradient_accumulation_steps} but --gradient_accumulation_steps is "
                        f"{config.gradient_accumulation_steps}: remove it from the config (the flag decides)")
    return accelerator


def main_process_log(accelerator):
    return print if accelerator.is_main_process else (lambda *a, **k: None)


__all__ = ["main_process_log", "make_accelerator", "reset_accelerate_state"]
