"""The public Python API: your own training script, and your own model family.

A training script (docs/api.md; `examples/qwen_image/simple_train.py` is a complete one):

    class MyModule(DiffusionTrainingModule):
        def __init__(self, device):
            super().__init__()
            self.pipe = QwenImagePipeline.from_pretrained(..., device=device)
            self.switch_pipe_to_training_mode(self.pipe, lora_base_model="dit", lora_target_modules="to_q,to_k")

        def forward(self, data):                       # one sample
            values = self.pipe.training_inputs(data)   # the inputs inference would get
            self.pipe.run_units(values)
            return sft_loss(self.pipe, values, self.generator)

    launch_training_task(accelerator, dataset, MyModule(accelerator.device), ModelLogger("out"), num_epochs=1)

A model family (docs/adding_a_family.md): `PipelineUnit`s with declarations, a `BasePipeline` subclass with
a `model_fn` (blocks wrapped in `gradient_checkpoint_forward`), and a `FamilySpec` (its models as
`ComponentSpec`s, tokenizers, LoRA naming) passed to `register_family`.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from .core import BasePipeline, FamilySpec, PipelineUnit, Split, TokenizerSpec, register_family, split_units
from .core.checkpointing import gradient_checkpoint_forward
from .data import UnifiedDataset
from .errors import UserError
from .media.image import images_to_tensor
from .media.video import read_video, save_video
from .core.family import detect_component, load_component
from .models import ComponentSpec, ModelConfig
from .schedulers import FlowMatchScheduler
from .training.checkpoint import ModelLogger, RunHooks
from .training.losses import direct_distill_loss as _direct_distill_batch
from .training.losses import flow_match_sft_loss as _sft_batch
from .training.losses import sample_generator
from .training.module import DiffusionTrainingModule


# -- losses for a forward(data) -------------------------------------------------------------------------

def _settings(pipe, values: dict[str, Any], overrides: dict[str, Any]) -> dict[str, Any]:
    # The reference passes these among the pipeline inputs; accept them there as well as as arguments.
    known = tuple(getattr(pipe, "model_fn_settings", BasePipeline.model_fn_settings))
    settings = {k: values[k] for k in known if values.get(k) is not None}
    settings.update({k: v for k, v in overrides.items() if v is not None})
    unknown = set(settings) - set(known)
    if unknown:
        raise TypeError(f"unknown loss setting(s) {sorted(unknown)}; known: {list(known)}")
    return settings


def sft_loss(pipe, values: dict[str, Any], generator: torch.Generator | None, **settings) -> torch.Tensor:
    """Flow-matching supervised loss of one sample whose units have run (values with a batch of one).

    Noise and timestep come only from `generator`; in a `DiffusionTrainingModule.forward` pass
    `self.generator`, which `launch_training_task` derives from (seed, epoch, sample index), so the result
    equals the `train` command's. Settings: `use_gradient_checkpointing`, `use_gradient_checkpointing_offload`.
    """
    if not isinstance(generator, torch.Generator):
        raise TypeError("sft_loss needs a torch.Generator: pass self.generator (set by launch_training_task for "
                        "each sample) or difftune.sample_generator(seed, epoch, index)")
    return _sft_batch(pipe, values, [generator], _settings(pipe, values, settings))


def direct_distill_loss(pipe, values: dict[str, Any], **settings) -> torch.Tensor:
    """Direct distillation of one sample: sample `num_inference_steps` steps from the seeded initial noise
    (`latents`) with gradients through every step; MSE against the teacher image's latents."""
    return _direct_distill_batch(pipe, values, [], _settings(pipe, values, settings))


# -- the launcher ---------------------------------------------------------------------------------------

class _PerSample(torch.nn.Module):
    """The loop calls `module(samples, indices, epoch)`; a user's module takes one sample, `forward(data)`.

    This view shares the user's submodules and parameters under the same names (so checkpoints, DDP and
    the optimizer see exactly the user's module) and calls the user's forward once per sample, with
    `model.generator` set to that sample's generator; the batch loss is the mean of the sample losses.
    """

    def __init__(self, model: DiffusionTrainingModule, seed: int):
        super().__init__()
        for name, child in model.named_children():
            self.add_module(name, child)
        for name, param in model.named_parameters(recurse=False):
            self.register_parameter(name, param)
        for name, buf in model.named_buffers(recurse=False):
            self.register_buffer(name, buf, persistent=name not in model._non_persistent_buffers_set)
        object.__setattr__(self, "model", model)  # not a submodule: its parameters are registered above
        self.seed = seed
        self.epoch = 0
        self.skipped: set[int] = set()

    @property
    def pipe(self):
        return self.model.pipe

    @property
    def lora_configs(self):
        return self.model.lora_configs

    def trainable_modules(self) -> list[torch.nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def trainable_param_names(self) -> list[str]:
        return [n for n, p in self.named_parameters() if p.requires_grad]

    def forward(self, samples: Sequence, indices: Iterable[int], epoch: int | None = None) -> torch.Tensor:
        epoch = self.epoch if epoch is None else epoch
        losses = []
        for sample, index in zip(samples, indices):
            if sample is None:  # a bad sample the data set was told to skip
                self.skipped.add(int(index))
                continue
            self.model.generator = sample_generator(self.seed, epoch, int(index))
            try:
                losses.append(self.model(sample))
            finally:
                self.model.generator = None
        if not losses:  # keep every parameter in the graph so DDP's gradient sync still happens
            return sum(p.sum() * 0.0 for p in self.trainable_modules())
        return torch.stack([loss.reshape(()) for loss in losses]).mean()


def launch_training_task(accelerator, dataset, model: DiffusionTrainingModule, model_logger: ModelLogger | None = None,
                         *, learning_rate: float = 1e-5, weight_decay: float = 1e-2, num_epochs: int = 1,
                         max_steps: int | None = None, batch_size: int = 1, seed: int = 0, num_workers: int = 0,
                         lr_scheduler: str = "constant", lr_warmup_steps: int = 0, max_grad_norm: float | None = None,
                         customized_optimizer: str | None = None, shuffle: bool = True,
                         progress: bool = True) -> dict:
    """Train `model` (a `DiffusionTrainingModule` whose `forward(data)` returns one sample's loss) on
    `dataset` with the same loop as `difftune train`: AdamW, seeded data order, noise and timesteps,
    gradient accumulation from the accelerator, checkpoints by `model_logger`, `train/loss` and `train/lr`
    to the accelerator's trackers.

    Returns {"steps", "losses" (per optimizer step), "seconds", "saved" (checkpoint paths)}.
    """
    from .training.fit import train
    from .training.loop import LoopConfig

    if not isinstance(model, DiffusionTrainingModule):
        raise TypeError(f"model must be a difftune.DiffusionTrainingModule, got {type(model).__name__}")
    if getattr(model, "pipe", None) is None:
        raise UserError(f"{type(model).__name__}.__init__ must set self.pipe (and call switch_pipe_to_training_mode)")
    model.to(accelerator.device)  # before the view shares its tensors, so both stay on one device
    config = LoopConfig(learning_rate=learning_rate, weight_decay=weight_decay, num_epochs=num_epochs,
                        max_steps=max_steps, batch_size=batch_size,
                        gradient_accumulation_steps=accelerator.gradient_accumulation_steps,
                        max_grad_norm=max_grad_norm, lr_scheduler=lr_scheduler, lr_warmup_steps=lr_warmup_steps,
                        seed=seed, num_workers=num_workers, customized_optimizer=customized_optimizer,
                        shuffle=shuffle, progress=progress)
    trackers = bool(accelerator.log_with) and not accelerator.trackers  # Accelerator(log_with="tensorboard", ...)
    if trackers:
        accelerator.init_trackers("train")
    hooks = RunHooks(model_logger, save_steps=model_logger.save_steps if model_logger is not None else None)
    summary = train(accelerator, dataset, _PerSample(model, seed), config, hooks)
    if trackers:
        accelerator.end_training()
    summary["saved"] = [str(p) for p in model_logger.saved] if model_logger is not None else []
    return summary


def pipeline_classes() -> dict[str, type]:
    """Every registered family's pipeline classes by name (QwenImagePipeline, FluxImagePipeline, WanVideoPipeline,
    the variants' classes, and any a plugin registers)."""
    from .core.family import families

    return {cls.__name__: cls for spec in families().values() for cls in spec.pipelines}


def __getattr__(name: str):
    classes = pipeline_classes() if name.endswith("Pipeline") else {}
    if name in classes:
        return classes[name]
    raise AttributeError(f"module 'difftune.api' has no attribute '{name}'")


__all__ = [
    # a training script (and every registered family's pipeline class: see pipeline_classes)
    "DiffusionTrainingModule", "FlowMatchScheduler", "ModelConfig", "ModelLogger",
    "UnifiedDataset", "direct_distill_loss", "pipeline_classes", "launch_training_task", "sample_generator", "sft_loss",
    # a model family
    "BasePipeline", "ComponentSpec", "FamilySpec", "PipelineUnit", "Split", "TokenizerSpec", "UserError", "detect_component",
    "gradient_checkpoint_forward", "images_to_tensor", "load_component", "register_family", "split_units",
    # video data
    "read_video", "save_video",
]
