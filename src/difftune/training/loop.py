"""The training loop on accelerate: a recipe that fits on a screen.

Policy that differs from the reference on purpose: the learning-rate schedule is stepped once per
optimizer step by us (accelerate would step a prepared scheduler once per process, and the reference's
`ConstantLR()` is an accidental lr/3 warm-up); step counts are optimizer steps, not micro-steps; data
order, noise and timesteps are seeded; the data loader is not sharded by accelerate (whose padding can
duplicate samples) but by `EpochPlan`, so any layout of processes and accumulation sees the same samples.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.utils.data import DataLoader
from tqdm.auto import tqdm

from .sampler import EpochPlan


@dataclass
class LoopConfig:
    learning_rate: float = 1e-4
    weight_decay: float = 0.01
    num_epochs: int = 1
    max_steps: int | None = None
    batch_size: int = 1
    gradient_accumulation_steps: int = 1
    max_grad_norm: float | None = None
    lr_scheduler: str = "constant"
    lr_warmup_steps: int = 0
    seed: int = 0
    num_workers: int = 0
    customized_optimizer: str | None = None
    progress: bool = True
    shuffle: bool = True
    resume_from: object = None  # a state directory (Path) to continue from exactly
    force_resume: bool = False
    exactness: dict = field(default_factory=dict)  # more settings an exact resume must find unchanged


@dataclass
class LoopState:
    """What the loop hands its hooks: the prepared objects and where it is."""

    accelerator: object
    module: object  # as prepared by accelerate (DDP-wrapped under several processes)
    optimizer: object
    schedule: object
    exactness: dict
    step: int = 0  # optimizer steps done
    epoch: int = 0
    step_in_epoch: int = 0  # optimizer steps done in this epoch

    @property
    def inner(self):
        return self.accelerator.unwrap_model(self.module)


class Hooks:
    """Called by the loop; subclass (e.g. `checkpoint.RunHooks`) to save, validate and log."""

    def after_step(self, state: LoopState, loss: float, lr: float) -> None:
        pass

    def after_epoch(self, state: LoopState) -> None:
        pass

    def at_end(self, state: LoopState) -> None:
        pass

    def on_stop(self, state: LoopState) -> None:
        """A stop was asked for (SIGTERM / SIGINT) after this step: save what is needed to continue."""

    def last_checkpoint(self):
        return None


def _list_collate(items):
    return items


class _EpochBatches:
    """A batch sampler whose batches are replaced each epoch (it is iterated in the main process)."""

    def __init__(self):
        self.batches: list[list[int]] = []

    def __iter__(self):
        return iter(list(self.batches))

    def __len__(self):
        return len(self.batches)


class _Indexed(torch.utils.data.Dataset):
    """Yields (index, sample) so the loss knows which sample (and so which noise) it has."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self):
        return len(self.dataset)

    def __getitem__(self, i):
        return i, self.dataset[i]


def make_optimizer(params, config: LoopConfig):
    if config.customized_optimizer:
        import importlib

        module_name, _, cls_name = config.customized_optimizer.rpartition(".")
        cls = getattr(importlib.import_module(module_name), cls_name)
        return cls(params, lr=config.learning_rate, weight_decay=config.weight_decay)
    return torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay)


def make_lr_schedule(optimizer, name: str, warmup: int, total: int):
    def factor(step: int) -> float:
        if name == "constant":
            return 1.0
        if warmup and step < warmup:
            return (step + 1) / warmup
        if name == "constant_with_warmup":
            return 1.0
        progress = (step - warmup) / max(1, total - warmup)
        progress = min(max(progress, 0.0), 1.0)
        if name == "linear":
            return 1.0 - progress
        return 0.5 * (1.0 + math.cos(math.pi * progress))  # cosine

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)


def stop_everywhere(accelerator, stop) -> int:
    """The signal number every process stops for (0: go on), agreed by all processes so they stop at one step."""
    if stop is None:
        return 0
    signum = int(stop.signum or 0)
    if accelerator.num_processes > 1:  # a signal may reach the processes at different steps
        flag = torch.tensor([float(signum)], device=accelerator.device)
        signum = int(accelerator.gather(flag).max().item())
    return signum


def train(accelerator, dataset, module, config: LoopConfig, hooks: Hooks | None = None,
          on_step: Callable[[int, float], None] | None = None, stop=None) -> dict:
    """Train `module` (forward(samples, indices, epoch) -> loss) on `dataset`; returns a summary dict.

    `stop` (a `signals.StopSignals`): checked after each optimizer step; when set, `hooks.on_stop` saves and
    the loop returns early with `summary["stopped"]` = the signal number."""
    from ..errors import UserError
    from .state import exactness_settings, load_training_state

    hooks = hooks or Hooks()
    world, rank = accelerator.num_processes, accelerator.process_index
    plan = EpochPlan(len(dataset), config.seed, world, rank, config.batch_size, config.gradient_accumulation_steps,
                     shuffle=config.shuffle, keys=bucket_keys(dataset, module))
    if plan.steps_per_epoch() == 0:
        raise UserError("the dataset is empty: nothing to train on")
    total_steps = plan.steps_per_epoch() * config.num_epochs
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)
    if accelerator.is_main_process:
        print(f"batches: {plan.describe()}")

    params = module.trainable_modules()
    if not params:
        raise UserError("nothing to train: set --trainable_models or --lora_base_model")
    optimizer = make_optimizer(params, config)
    schedule = make_lr_schedule(optimizer, config.lr_scheduler, config.lr_warmup_steps, total_steps)
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None and plugin.is_auto("train_micro_batch_size_per_gpu"):
        # No DataLoader goes through prepare(), so DeepSpeed cannot read the micro-batch size from one.
        plugin.deepspeed_config["train_micro_batch_size_per_gpu"] = config.batch_size
    module, optimizer = accelerator.prepare(module, optimizer)
    state = LoopState(accelerator, module, optimizer, schedule, exactness_settings(config, world, len(dataset)))
    inner = state.inner

    start_epoch, start_step = 0, 0
    if config.resume_from is not None:
        position = load_training_state(config.resume_from, accelerator, module, optimizer, schedule,
                                       state.exactness, force=config.force_resume)
        state.step, start_epoch, start_step = position["global_step"], position["epoch"], position["step_in_epoch"]
        if start_step >= plan.steps_per_epoch():
            start_epoch, start_step = start_epoch + 1, 0
        if accelerator.is_main_process:
            print(f"resumed from {config.resume_from}: step {state.step}, epoch {start_epoch}, "
                  f"{start_step} step(s) into the epoch")

    # One loader for the whole run (workers start once); the batches of each epoch are swapped in.
    batches = _EpochBatches()
    workers = min(config.num_workers, os.cpu_count() or 1)  # more workers than cores only slows loading
    loader = DataLoader(_Indexed(dataset), batch_sampler=batches, collate_fn=_list_collate,
                        num_workers=workers, persistent_workers=workers > 0)
    bar = tqdm(total=total_steps, initial=state.step, disable=not (config.progress and accelerator.is_main_process),
               desc="training", dynamic_ncols=True)
    losses, started, ema, stopped = [], time.perf_counter(), None, 0
    for epoch in range(start_epoch, config.num_epochs):
        if state.step >= total_steps or stopped:
            break
        inner.epoch = state.epoch = epoch
        first = start_step if epoch == start_epoch else 0
        plan_batches = list(plan.micro_batches(epoch, start_step=first))
        batches.batches = [idx for _, _, idx, _ in plan_batches]
        micro_losses = []
        for (step_in_epoch, _, _, in_step), items in zip(plan_batches, loader):
            indices = [i for i, _ in items]
            samples = [s for _, s in items]
            with accelerator.accumulate(module):
                loss = module(samples, indices, epoch)
                # the step's gradient is the mean over its samples whatever the layout: weigh micro-batches
                # by their share of the step (1 for the equal micro-batches of a full step)
                share = world * config.gradient_accumulation_steps * len(items) / in_step
                weighted = loss if share == 1 else loss * share
                check_finite(accelerator, loss, state.step + 1, epoch, samples, indices, hooks.last_checkpoint())
                accelerator.backward(weighted)
                micro_losses.append(loss.detach().float() * len(items))
                if accelerator.sync_gradients and config.max_grad_norm:
                    accelerator.clip_grad_norm_(params, config.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if not accelerator.sync_gradients:
                continue
            lr = schedule.get_last_lr()[0]  # the rate this step used
            schedule.step()
            state.step, state.step_in_epoch = state.step + 1, step_in_epoch + 1
            step_loss = (accelerator.reduce(torch.stack(micro_losses).sum(), reduction="sum") / in_step).item()
            micro_losses = []
            losses.append(step_loss)
            ema = step_loss if ema is None else 0.9 * ema + 0.1 * step_loss
            accelerator.log({"train/loss": step_loss, "train/lr": lr}, step=state.step)
            bar.set_postfix(loss=f"{ema:.4f}", lr=f"{lr:.2e}", epoch=epoch)
            bar.update(1)
            if on_step is not None:
                on_step(state.step, step_loss)
            hooks.after_step(state, step_loss, lr)
            stopped = stop_everywhere(accelerator, stop)
            if stopped:
                hooks.on_stop(state)
                break
            if state.step >= total_steps:
                break
        if stopped:
            break
        hooks.after_epoch(state)  # also when --max_steps ended the epoch early (its checkpoint is the last)
    if not stopped:
        hooks.at_end(state)
    bar.close()
    accelerator.wait_for_everyone()
    summary = {"steps": state.step, "losses": losses, "seconds": time.perf_counter() - started}
    if stopped:
        summary["stopped"] = stopped
    return summary


def bucket_keys(dataset, module) -> list | None:
    """Each sample's bucket (what must agree for samples to share a batch), if the data set can tell; the
    module's pipeline says which data values must agree besides the shapes (e.g. a step count)."""
    if not hasattr(dataset, "bucket_keys"):
        return None
    from ..core.batch import SAME

    pipe = getattr(module, "pipe", None)
    same = [k for k, r in (getattr(pipe, "input_batching", None) or {}).items() if r == SAME]
    return dataset.bucket_keys(same)


def check_finite(accelerator, loss, step: int, epoch: int, samples, indices, last_checkpoint=None) -> None:
    """Stop on a NaN/Inf loss before it reaches the weights, on every process at once, naming the samples."""
    bad = torch.tensor([0.0 if torch.isfinite(loss).all() else 1.0], device=loss.device)
    if accelerator.num_processes > 1:
        bad = accelerator.reduce(bad, reduction="sum")
    if bad.item() == 0:
        return
    from ..errors import UserError

    ids = [str(s.get("_id", i)) if isinstance(s, dict) else str(i) for s, i in zip(samples, indices)]
    where = f"the last good checkpoint is {last_checkpoint}" if last_checkpoint else \
        "no checkpoint was saved before it"
    raise UserError(f"non-finite loss at step {step} (epoch {epoch}, sample(s) {', '.join(ids)}); training stopped "
                    f"before updating the weights; {where}")
