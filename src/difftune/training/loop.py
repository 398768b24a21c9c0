"""The training loop on accelerate: it only loops (forward, backward, step, log, hooks); `fit.py` builds what it
loops over (the epoch plan, the optimizer and LR schedule, the prepared module, the resumed position, the loader).

Policy that differs from the reference on purpose: the learning-rate schedule is stepped once per
optimizer step by us (accelerate would step a prepared scheduler once per process, and the reference's
`ConstantLR()` is an accidental lr/3 warm-up); step counts are optimizer steps, not micro-steps; data
order, noise and timesteps are seeded; the data loader is not sharded by accelerate (whose padding can
duplicate samples) but by `EpochPlan`, so any layout of processes and accumulation sees the same samples.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm


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
    optimizer_cpu_offload: bool = False  # the optimizer's state and step on the host (optimizer_offload.py)
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


def stop_everywhere(accelerator, stop) -> int:
    """The signal number every process stops for (0: go on), agreed by all processes so they stop at one step."""
    if stop is None:
        return 0
    signum = int(stop.signum or 0)
    if accelerator.num_processes > 1:  # a signal may reach the processes at different steps
        flag = torch.tensor([float(signum)], device=accelerator.device)
        signum = int(accelerator.gather(flag).max().item())
    return signum


def loop(training, hooks: Hooks | None = None, on_step: Callable[[int, float], None] | None = None,
         stop=None) -> dict:
    """Train over `training` (fit.Training); returns a summary dict.

    `stop` (a `signals.StopSignals`): checked after each optimizer step; when set, `hooks.on_stop` saves and
    the loop returns early with `summary["stopped"]` = the signal number."""
    hooks = hooks or Hooks()
    t = training
    accelerator, module, optimizer, schedule, state, config = (t.accelerator, t.module, t.optimizer, t.schedule,
                                                               t.state, t.config)
    world = accelerator.num_processes
    inner = state.inner
    bar = tqdm(total=t.total_steps, initial=state.step,
               disable=not (config.progress and accelerator.is_main_process), desc="training", dynamic_ncols=True)
    losses, started, ema, stopped = [], time.perf_counter(), None, 0
    for epoch in range(t.start_epoch, config.num_epochs):
        if state.step >= t.total_steps or stopped:
            break
        inner.epoch = state.epoch = epoch
        first = t.start_step if epoch == t.start_epoch else 0
        plan_batches = list(t.plan.micro_batches(epoch, start_step=first))
        t.batches.batches = [idx for _, _, idx, _ in plan_batches]
        micro_losses = []
        for (step_in_epoch, _, _, in_step), items in zip(plan_batches, t.loader):
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
                    accelerator.clip_grad_norm_(t.params, config.max_grad_norm)
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
            if state.step >= t.total_steps:
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
