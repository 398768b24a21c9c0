"""What the loop loops over, built once: the epoch plan (buckets, steps, this process's micro-batches), the optimizer
and learning-rate schedule, the module and optimizer prepared by accelerate, the resumed position, and one data
loader for the whole run whose batches are swapped in each epoch."""

from __future__ import annotations

import dataclasses
import math
import os
from dataclasses import dataclass

import torch
from torch.utils.data import DataLoader

from ..errors import UserError
from . import engines
from .loop import LoopConfig, LoopState, bucket_keys
from .sampler import EpochPlan


@dataclass
class Training:
    accelerator: object
    config: LoopConfig
    plan: EpochPlan
    total_steps: int
    params: list
    module: object  # prepared
    optimizer: object
    schedule: object
    state: LoopState
    loader: DataLoader
    batches: _EpochBatches
    start_epoch: int = 0
    start_step: int = 0
    copies: object = None  # lora.ComputeCopies: the LoRA layers computing in the autocast dtype


def make_optimizer(params, config: LoopConfig, accelerator=None):
    """The optimizer (--customized_optimizer or AdamW); with --enable_optimizer_cpu_offload, built over host copies
    of the parameters and stepped there."""
    if config.optimizer_cpu_offload:
        from .offload import refuse_sharded_engines
        from .optimizer_offload import HostOptimizer

        if accelerator is not None:
            refuse_sharded_engines(accelerator, "--enable_optimizer_cpu_offload")
            if accelerator.mixed_precision == "fp16":
                raise UserError("--enable_optimizer_cpu_offload with fp16 mixed precision: not supported (the loss "
                                "scaler unscales the gradients the optimizer holds, which live on the GPU); use "
                                "bf16 (--mixed_precision bf16)")
        plain = dataclasses.replace(config, optimizer_cpu_offload=False)
        return HostOptimizer(params, lambda host: make_optimizer(host, plain))
    if config.customized_optimizer:
        import importlib

        module_name, _, cls_name = config.customized_optimizer.rpartition(".")
        cls = getattr(importlib.import_module(module_name), cls_name)
        return cls(params, lr=config.learning_rate, weight_decay=config.weight_decay)
    # fused: one call per update for all tensors (torch picks a per-tensor loop on the CPU, foreach on CUDA)
    return torch.optim.AdamW(params, lr=config.learning_rate, weight_decay=config.weight_decay,
                             fused=all(p.device.type in ("cpu", "cuda") for p in params) or None)


def compute_copies(accelerator, module, config: LoopConfig):
    """`--lora_compute auto`: the trained LoRA layers compute in the autocast dtype from their fp32 weights, in one
    process without a sharding engine (DDP, FSDP2 and DeepSpeed reduce the parameters' own gradients)."""
    from accelerate.utils import DistributedType

    from ..lora.compute import ComputeCopies, compute_dtype

    dtype = compute_dtype(accelerator.mixed_precision)
    if (config.lora_compute != "auto" or dtype is None or accelerator.num_processes != 1
            or accelerator.distributed_type != DistributedType.NO):
        return None
    copies = ComputeCopies(accelerator.unwrap_model(module), dtype)
    return copies if len(copies) else None


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


class _StandIn:
    """A good sample for a process whose micro-batch holds only bad samples (--on_bad_sample skip), under an engine
    whose forward is a collective call (FSDP2, ZeRO-3): that process runs its forward on this one, weighted 0."""

    def __init__(self, dataset):
        self.dataset, self.found = dataset, None

    def __call__(self):
        if self.found is None:
            for i in range(len(self.dataset)):
                sample = self.dataset[i]
                if sample is not None:
                    self.found = (sample, i)
                    break
            else:
                raise UserError("every sample of the data set failed to load: nothing to train on")
        return self.found


def _plan(accelerator, dataset, module, config: LoopConfig) -> tuple[EpochPlan, int]:
    """The epoch plan of this process and the run's number of optimizer steps."""
    world, rank = accelerator.num_processes, accelerator.process_index
    plan = EpochPlan(len(dataset), config.seed, world, rank, config.batch_size, config.gradient_accumulation_steps,
                     shuffle=config.shuffle, keys=bucket_keys(dataset, module))
    if plan.steps_per_epoch() == 0:
        raise UserError("the dataset is empty: nothing to train on")
    total_steps = plan.steps_per_epoch() * config.num_epochs
    if config.max_steps is not None:
        total_steps = min(total_steps, config.max_steps)
    return plan, total_steps


def _check_position(config: LoopConfig, position: dict, steps_per_epoch: int, total_steps: int) -> None:
    """A saved position this run can continue from; one past its end would train nothing, and the run would still
    save and take the folder."""
    step, epoch = position["global_step"], position["epoch"]
    if position["step_in_epoch"] >= steps_per_epoch:
        epoch += 1
    if step >= total_steps:
        raise UserError(f"--resume_from_checkpoint {config.resume_from}: its global_step {step} is at or "
                        f"past this run's last step ({total_steps}); raise --num_epochs or --max_steps to "
                        f"train on")
    if epoch >= config.num_epochs:
        raise UserError(f"--resume_from_checkpoint {config.resume_from}: its epoch {position['epoch']} is past this "
                        f"run's last epoch ({config.num_epochs - 1}: --num_epochs {config.num_epochs}, counted from "
                        f"0); raise --num_epochs to train on")


def check_resume(accelerator, dataset, module, config: LoopConfig, plain_optimizer: bool = True) -> None:
    """Before anything is written under the output folder: the state `config.resume_from` names fits this run (its
    trained tensors' names and shapes) and its position is inside it."""
    from .state import check_settings, check_state_fits, exactness_settings, read_meta

    if config.resume_from is None:
        return
    settings = exactness_settings(config, accelerator.num_processes, len(dataset))
    check_settings(config.resume_from, read_meta(config.resume_from)["settings"], settings, config.force_resume)
    check_state_fits(config.resume_from, module, plain_optimizer)
    plan, total_steps = _plan(accelerator, dataset, module, config)
    _check_position(config, read_meta(config.resume_from)["position"], plan.steps_per_epoch(), total_steps)


def prepare(accelerator, dataset, module, config: LoopConfig) -> Training:
    """The plan, optimizer, schedule, prepared module, resumed position and loader of one training run."""
    from .state import exactness_settings, load_training_state

    world = accelerator.num_processes
    plan, total_steps = _plan(accelerator, dataset, module, config)
    if accelerator.is_main_process:
        print(f"batches: {plan.describe()}")

    params = module.trainable_modules()
    if not params:
        raise UserError("nothing to train: set --trainable_models or --lora_base_model")
    optimizer = make_optimizer(params, config, accelerator)
    if config.optimizer_cpu_offload and accelerator.is_main_process:
        moved = sum(p.numel() * p.element_size() for p in params)
        print(f"optimizer offload: the optimizer state and step of {len(params)} trainable tensors "
              f"({moved / 2 ** 20:.1f} MiB) on the host; gradients accumulate on {accelerator.device}")
    schedule = make_lr_schedule(optimizer, config.lr_scheduler, config.lr_warmup_steps, total_steps)
    chosen = engines.before_prepare(accelerator, module, config.batch_size, config.max_grad_norm)
    if engines.shards_weights(accelerator) and hasattr(module, "stand_in"):
        module.stand_in = _StandIn(dataset)
    module, optimizer = accelerator.prepare(module, optimizer)
    params = engines.trainable_parameters(module)  # the prepared ones: what clipping must see
    if accelerator.is_main_process:
        print(engines.engine_line(accelerator, chosen))
    state = LoopState(accelerator, module, optimizer, schedule, exactness_settings(config, world, len(dataset)))

    start_epoch, start_step = 0, 0
    if config.resume_from is not None:
        position = load_training_state(config.resume_from, accelerator, module, optimizer, schedule,
                                       state.exactness, force=config.force_resume)
        _check_position(config, position, plan.steps_per_epoch(), total_steps)
        state.step, start_epoch, start_step = position["global_step"], position["epoch"], position["step_in_epoch"]
        if start_step >= plan.steps_per_epoch():
            start_epoch, start_step = start_epoch + 1, 0
        if accelerator.is_main_process:
            print(f"resumed from {config.resume_from}: step {state.step}, epoch {start_epoch}, "
                  f"{start_step} step(s) into the epoch")

    copies = compute_copies(accelerator, module, config)  # after a resume: built from the loaded weights

    # One loader for the whole run (workers start once); the batches of each epoch are swapped in.
    batches = _EpochBatches()
    workers = min(config.num_workers, os.cpu_count() or 1)  # more workers than cores only slows loading
    loader = DataLoader(_Indexed(dataset), batch_sampler=batches, collate_fn=_list_collate,
                        num_workers=workers, persistent_workers=workers > 0)
    return Training(accelerator, config, plan, total_steps, params, module, optimizer, schedule, state, loader,
                    batches, start_epoch, start_step, copies)


def train(accelerator, dataset, module, config: LoopConfig, hooks=None, on_step=None, stop=None) -> dict:
    """Prepare and loop: train `module` (forward(samples, indices, epoch) -> loss) on `dataset`; a summary dict."""
    from .loop import loop

    return loop(prepare(accelerator, dataset, module, config), hooks, on_step=on_step, stop=stop)


__all__ = ["Training", "check_resume", "make_lr_schedule", "make_optimizer", "prepare", "train"]
