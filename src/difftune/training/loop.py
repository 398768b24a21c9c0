"""The training loop on accelerate: it only loops (forward, backward, step, log, hooks); `fit.py` builds what it
loops over (the epoch plan, the optimizer and LR schedule, the prepared module, the resumed position, the loader).

Policy that differs from the reference on purpose: the learning-rate schedule is stepped once per
optimizer step by us (accelerate would step a prepared scheduler once per process, and the reference's
`ConstantLR()` is an accidental lr/3 warm-up); step counts are optimizer steps, not micro-steps; data
order, noise and timesteps are seeded; the data loader is not sharded by accelerate (whose padding can
duplicate samples) but by `EpochPlan`, so any layout of processes and accumulation sees the same samples.
"""

from __future__ import annotations

import math
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
    loss_readback_steps: int = 10  # read the step losses back from the device every N steps
    lora_compute: str = "auto"  # auto: LoRA computes in the autocast dtype from fp32 masters; fp32: peft's own


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
    flush: Callable[[], None] = lambda: None  # read back (and check) the losses not read yet

    @property
    def inner(self):
        return self.accelerator.unwrap_model(self.module)


class Hooks:
    """Called by the loop; subclass (e.g. `checkpoint.RunHooks`) to save, validate and log."""

    def after_step(self, state: LoopState, loss: float | None, lr: float) -> None:
        """`loss`: the step's loss where it was read back this step, else None (see `log_losses`); call
        `state.flush()` before saving."""

    def log_losses(self, state: LoopState, rows: list[tuple[int, int, float, float]]) -> None:
        """Step losses just read back: (step, epoch, loss, lr) rows, in step order."""

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
    the loop returns early with `summary["stopped"]` = the signal number.

    The step's loss stays on the device until it is read back (`Losses`): every `loss_readback_steps` steps, before a
    hook saves or validates (`state.flush()`), with an `on_step` callback every step, and at the end; every step's
    loss is then logged, with its own step number."""
    hooks = hooks or Hooks()
    t = training
    accelerator, module, optimizer, schedule, state, config = (t.accelerator, t.module, t.optimizer, t.schedule,
                                                               t.state, t.config)
    world = accelerator.num_processes
    inner = state.inner
    copies = getattr(t, "copies", None)
    bar = tqdm(total=t.total_steps, initial=state.step,
               disable=not (config.progress and accelerator.is_main_process), desc="training", dynamic_ncols=True)
    started, stopped = time.perf_counter(), 0
    read = Losses(accelerator, bar, hooks, state)
    state.flush = read.flush
    parts = StreamLosses(getattr(inner, "pipe", None))
    every = 1 if on_step is not None else max(1, int(config.loss_readback_steps or 1))
    try:
        for epoch in range(t.start_epoch, config.num_epochs):
            if state.step >= t.total_steps or stopped:
                break
            inner.epoch = state.epoch = epoch
            first = t.start_step if epoch == t.start_epoch else 0
            plan_batches = list(t.plan.micro_batches(epoch, start_step=first))
            t.batches.batches = [idx for _, _, idx, _ in plan_batches]
            micro_losses, step_samples = [], []
            for (step_in_epoch, _, _, in_step), items in zip(plan_batches, t.loader):
                indices = [i for i, _ in items]
                samples = [s for _, s in items]
                with accelerator.accumulate(module):
                    loss = module(samples, indices, epoch)
                    # the step's gradient is the mean over its samples whatever the layout: weigh micro-batches
                    # by their share of the step (1 for the equal micro-batches of a full step)
                    share = world * config.gradient_accumulation_steps * len(items) / in_step
                    weighted = loss if share == 1 else loss * share
                    accelerator.backward(weighted)
                    if copies is not None:
                        copies.collect()
                    micro_losses.append(loss.detach().float() * len(items))
                    parts.collect(len(items))
                    step_samples.extend(zip(samples, indices))
                    if accelerator.sync_gradients and config.max_grad_norm:
                        accelerator.clip_grad_norm_(t.params, config.max_grad_norm)
                    optimizer.step()
                    optimizer.zero_grad(set_to_none=True)
                if not accelerator.sync_gradients:
                    continue
                if copies is not None:
                    copies.refresh()
                lr = schedule.get_last_lr()[0]  # the rate this step used
                schedule.step()
                state.step, state.step_in_epoch = state.step + 1, step_in_epoch + 1
                total = micro_losses[0] if len(micro_losses) == 1 else torch.stack(micro_losses).sum()
                if world > 1:
                    total = accelerator.reduce(total, reduction="sum")
                read.add(state.step, epoch, total / in_step, lr, step_samples, parts.step(accelerator))
                micro_losses, step_samples = [], []
                bar.update(1)
                if state.step % every == 0 or state.step >= t.total_steps:
                    read.flush()
                if on_step is not None:
                    on_step(state.step, read.losses[-1])
                hooks.after_step(state, read.losses[-1] if read.current(state.step) else None, lr)
                stopped = stop_everywhere(accelerator, stop)
                if stopped:
                    read.flush()
                    hooks.on_stop(state)
                    break
                if state.step >= t.total_steps:
                    break
            if stopped:
                break
            read.flush()
            hooks.after_epoch(state)  # also when --max_steps ended the epoch early (its checkpoint is the last)
        read.flush()
        if not stopped:
            hooks.at_end(state)
    finally:
        if copies is not None:
            copies.remove()
    bar.close()
    accelerator.wait_for_everyone()
    summary = {"steps": state.step, "losses": read.losses, "seconds": time.perf_counter() - started}
    if stopped:
        summary["stopped"] = stopped
    return summary


class Losses:
    """Step losses kept on the device until read back, all at once (one host sync for many steps).

    Reading them back also checks them: a NaN/Inf loss stops training there, on every process (the losses are reduced
    over the processes, so each sees the same values at the same step), naming the step and its samples. Hooks call
    `state.flush()` before they save, so no checkpoint is written after a non-finite loss."""

    def __init__(self, accelerator, bar, hooks, state):
        self.accelerator, self.bar, self.hooks, self.state = accelerator, bar, hooks, state
        self.pending: list[tuple] = []  # (step, epoch, loss tensor, lr, [(sample, index)])
        self.losses: list[float] = []
        self.ema: float | None = None
        self.read_step = 0

    def add(self, step: int, epoch: int, loss, lr: float, samples, parts=None) -> None:
        """`parts`: the step's loss per stream of a target of several (`StreamLosses.step`), or None."""
        self.pending.append((step, epoch, loss, lr, samples, parts))

    def current(self, step: int) -> bool:
        return self.read_step == step

    def flush(self) -> None:
        if not self.pending:
            return
        pending, self.pending = self.pending, []
        values = torch.stack([p[2] for p in pending]).tolist()  # the one read-back
        streams = [p[5] for p in pending]
        streams = [None if p is None else {k: v.tolist() for k, v in p.items()} for p in streams]
        rows = []
        for (step, epoch, _, lr, samples, _), value, per_stream in zip(pending, values, streams):
            if not math.isfinite(value):
                raise_non_finite(step, epoch, samples, self.hooks.last_checkpoint(), self.state.step)
            self.losses.append(value)
            self.ema = value if self.ema is None else 0.9 * self.ema + 0.1 * value
            logged = {"train/loss": value, "train/lr": lr}
            for name, (total, count) in (per_stream or {}).items():
                if count > 0:  # a stream the step's samples had no data of (a clip without sound) is left out
                    logged[f"train/loss_{name}"] = total / count
            self.accelerator.log(logged, step=step)
            rows.append((step, epoch, value, lr))
        self.read_step = pending[-1][0]
        self.hooks.log_losses(self.state, rows)
        self.bar.set_postfix(loss=f"{self.ema:.4f}", lr=f"{rows[-1][3]:.2e}", epoch=rows[-1][1])


class StreamLosses:
    """The loss of each stream of a target of several (a clip and its sound), as the loss function leaves it on the
    pipeline (`pipe.stream_losses`: stream name -> the micro-batch's mean), averaged over a step's samples that
    have the stream: logged as train/loss_<stream> beside train/loss, so a stream whose loss stops moving shows."""

    def __init__(self, pipe):
        streams = getattr(getattr(pipe, "target", None), "streams", ())
        self.pipe = pipe
        self.names = [s.name for s in streams] if len(streams) > 1 else []
        self.sums = None

    def collect(self, samples: int) -> None:
        if not self.names:
            return
        found = getattr(self.pipe, "stream_losses", None) or {}
        self.pipe.stream_losses = None
        row = torch.zeros(2, len(self.names))
        for i, name in enumerate(self.names):
            if name in found:
                row[0, i] = found[name].detach().float().cpu() * samples
                row[1, i] = samples
        self.sums = row if self.sums is None else self.sums + row

    def step(self, accelerator):
        """This step's (sum, samples) per stream, reduced over the processes; None for a single-stream target."""
        if not self.names or self.sums is None:
            return None
        sums, self.sums = self.sums, None
        if accelerator.num_processes > 1:
            sums = accelerator.reduce(sums.to(accelerator.device), reduction="sum").cpu()
        return {name: sums[:, i] for i, name in enumerate(self.names)}


def bucket_keys(dataset, module) -> list | None:
    """Each sample's bucket (what must agree for samples to share a batch), if the data set can tell; the
    module's pipeline says which data values must agree besides the shapes (e.g. a step count)."""
    if not hasattr(dataset, "bucket_keys"):
        return None
    from ..core.batch import SAME

    pipe = getattr(module, "pipe", None)
    same = [k for k, r in (getattr(pipe, "input_batching", None) or {}).items() if r == SAME]
    return dataset.bucket_keys(same)


def raise_non_finite(step: int, epoch: int, samples, last_checkpoint=None, now: int | None = None) -> None:
    """Stop on a NaN/Inf loss, naming the step and its samples, and the last checkpoint saved before it."""
    from ..errors import UserError

    ids = [str(s.get("_id", i)) if isinstance(s, dict) else str(i) for s, i in samples]
    where = f"the last good checkpoint is {last_checkpoint}" if last_checkpoint else \
        "no checkpoint was saved before it"
    later = f" (found at step {now})" if now is not None and now != step else ""
    raise UserError(f"non-finite loss at step {step} (epoch {epoch}, sample(s) {', '.join(ids)}){later}; training "
                    f"stopped and nothing was saved after it; {where}")
