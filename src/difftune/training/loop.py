"""The training loop on accelerate: a recipe that fits on a screen.

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
    save_steps: int | None = None
    customized_optimizer: str | None = None
    progress: bool = True
    shuffle: bool = True
    extra: dict = field(default_factory=dict)


def _list_collate(items):
    return items


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


def train(accelerator, dataset, module, config: LoopConfig, saver=None,
          on_step: Callable[[int, float], None] | None = None) -> dict:
    """Train `module` (forward(samples, indices, epoch) -> loss) on `dataset`; returns a summary dict."""
    world, rank = accelerator.num_processes, accelerator.process_index
    plan = EpochPlan(len(dataset), config.seed, world, rank, config.batch_size, config.gradient_accumulation_steps,
                     shuffle=config.shuffle)
    if plan.steps_per_epoch() == 0:
        from ..errors import UserError

        raise UserError(f"the dataset has {len(dataset)} samples, fewer than one optimizer step needs "
                        f"({plan.group} = processes x --batch_size x --gradient_accumulation_steps)")
    total_steps = plan.steps_per_epoch() * config.num_epochs
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)
    if plan.dropped_per_epoch() and accelerator.is_main_process:
        print(f"note: {plan.dropped_per_epoch()} sample(s) per epoch do not fill a whole optimizer step and are "
              f"left out of that epoch (a different few each epoch)")

    params = module.trainable_modules()
    if not params:
        from ..errors import UserError

        raise UserError("nothing to train: set --trainable_models or --lora_base_model")
    optimizer = make_optimizer(params, config)
    schedule = make_lr_schedule(optimizer, config.lr_scheduler, config.lr_warmup_steps, total_steps)
    module, optimizer = accelerator.prepare(module, optimizer)
    inner = accelerator.unwrap_model(module)

    bar = tqdm(total=total_steps, disable=not (config.progress and accelerator.is_main_process), desc="training",
               dynamic_ncols=True)
    step, losses, started = 0, [], time.perf_counter()
    ema = None
    for epoch in range(config.num_epochs):
        if step >= total_steps:
            break
        inner.epoch = epoch
        batches = [idx for _, _, idx in plan.micro_batches(epoch)]
        loader = DataLoader(_Indexed(dataset), batch_sampler=batches, collate_fn=_list_collate,
                            num_workers=config.num_workers, persistent_workers=False)
        micro_losses = []
        for items in loader:
            indices = [i for i, _ in items]
            samples = [s for _, s in items]
            with accelerator.accumulate(module):
                loss = module(samples, indices, epoch)
                accelerator.backward(loss)
                micro_losses.append(loss.detach().float())
                if accelerator.sync_gradients and config.max_grad_norm:
                    accelerator.clip_grad_norm_(params, config.max_grad_norm)
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)
            if not accelerator.sync_gradients:
                continue
            lr = schedule.get_last_lr()[0]  # the rate this step used
            schedule.step()
            step += 1
            step_loss = accelerator.reduce(torch.stack(micro_losses).mean(), reduction="mean").item()
            micro_losses = []
            losses.append(step_loss)
            ema = step_loss if ema is None else 0.9 * ema + 0.1 * step_loss
            accelerator.log({"train/loss": step_loss, "train/lr": lr}, step=step)
            bar.set_postfix(loss=f"{ema:.4f}", lr=f"{lr:.2e}", epoch=epoch)
            bar.update(1)
            if on_step is not None:
                on_step(step, step_loss)
            if saver is not None and config.save_steps and step % config.save_steps == 0:
                saver.save(accelerator, module, f"step-{step}")
            if step >= total_steps:
                break
        if saver is not None and not config.save_steps:
            saver.save(accelerator, module, f"epoch-{epoch}")
    if saver is not None and config.save_steps and step % config.save_steps != 0:
        saver.save(accelerator, module, f"step-{step}")
    bar.close()
    accelerator.wait_for_everyone()
    return {"steps": step, "losses": losses, "seconds": time.perf_counter() - started}
