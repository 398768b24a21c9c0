"""Training modules: a pipeline switched to training mode, whose forward runs units and returns a loss.

`DiffusionTrainingModule` is the public base class for custom training scripts (the reference's shape:
subclass, load a pipeline in `__init__`, switch it to training mode, compute the loss in `forward`).
`PipelineTrainingModule` is the one the `train` command builds from flags; it runs a given list of
units (all of them in one-stage training, the stage-2 units when training from a cache).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch

from ..core.attention import NO_MASK, unpadded
from ..core.batch import LIST, collate_values, split_batch
from ..errors import UserError
from ..util import names as _names
from .losses import all_losses, sample_generator


def lora_targets(pipe, slot: str, targets: list[str]) -> list[str]:
    """`--lora_target_modules` with the family's aliases for `slot` expanded (the reference's own module names,
    e.g. FLUX's fused `a_to_qkv`, onto the diffusers modules that hold those weights). An alias may name modules by
    a path with `*` standing for one part (`single_transformer_blocks.*.proj_out`): it becomes the full names of the
    model's modules it matches, which peft takes as they are. A variant pipeline class whose model in that slot names
    its modules otherwise gives its own aliases (`BasePipeline.lora_target_aliases`)."""
    import fnmatch

    family = getattr(pipe, "spec", None)
    own = getattr(pipe, "lora_target_aliases", None)
    aliases = dict((own if own is not None else getattr(family, "lora_target_aliases", None) or {}).get(slot, {}))
    model = pipe.models.get(slot) if hasattr(pipe, "models") else None
    modules = [n for n, _ in model.named_modules()] if model is not None else []
    out, shown = [], []
    for t in targets:
        for name in _names(aliases.get(t, t)):
            shown.append(name)
            if "*" in name and t in aliases:
                parts = name.count(".") + 1
                found = [m for m in modules if m.count(".") + 1 == parts and fnmatch.fnmatchcase(m, name)]
                expanded = found or [name]  # nothing matched: left for the target check to refuse
            else:
                expanded = [name]
            out.extend(n for n in expanded if n not in out)
    if shown != targets:
        print(f"note: --lora_target_modules in {slot}'s module names: {','.join(dict.fromkeys(shown))}")
    return out


def _fused_aliases(pipe, slot: str) -> tuple[str, ...]:
    own = getattr(pipe, "lora_fused_aliases", None)
    return tuple((own if own is not None else getattr(getattr(pipe, "spec", None), "lora_fused_aliases", None)
                  or {}).get(slot, ()))


def lora_fused_groups(pipe, slot: str, targets: list[str]) -> list[tuple[str, ...]]:
    """The groups of `slot`'s modules that train one adapter each (`FamilySpec.lora_fused_aliases`: names of
    one Linear layer in the reference's model, e.g. a fused q/k/v): for each such name in `--lora_target_modules`, the
    modules its alias's paths select, grouped by the values of their `*` parts (one block), in the alias's order (the
    rows of the reference's fused layer). A group the model lacks a part of is none."""
    import re

    family = getattr(pipe, "spec", None)
    own = getattr(pipe, "lora_target_aliases", None)
    aliases = (own if own is not None else getattr(family, "lora_target_aliases", None) or {}).get(slot, {})
    fused = _fused_aliases(pipe, slot)
    model = pipe.models.get(slot) if hasattr(pipe, "models") else None
    if model is None or not fused:
        return []
    modules = [n for n, _ in model.named_modules() if n]
    groups: list[tuple[str, ...]] = []
    for target in dict.fromkeys(targets):
        if target not in fused or target not in aliases:
            continue
        patterns = _names(aliases[target])
        found: dict[tuple, dict[int, str]] = {}
        for i, pattern in enumerate(patterns):
            rx = re.compile("^" + "([^.]+)".join(re.escape(part) for part in pattern.split("*")) + "$")
            for name in modules:
                m = rx.match(name)
                if m:
                    found.setdefault(m.groups(), {})[i] = name
        groups.extend(tuple(parts[i] for i in range(len(patterns))) for parts in found.values()
                      if len(parts) == len(patterns))
    return groups


def share_fused_lora(pipe, slot: str, targets: list[str], source: str | None = None) -> None:
    """The reference's fused layers named in `targets` as one adapter each (`lora_fused_groups`, `share_lora`);
    a group a --lora_checkpoint file holds as separate adapters stays so, with a note."""
    from ..lora import share_lora

    groups = lora_fused_groups(pipe, slot, targets)
    if not groups:
        return
    left = share_lora(pipe.models[slot], groups)
    names = [t for t in dict.fromkeys(targets) if t in _fused_aliases(pipe, slot)]
    print(f"note: --lora_target_modules {','.join(names)}: one adapter per fused layer of the "
          f"reference's model ({len(groups) - len(left)} layers: one lora_A shared by their parts here, one lora_B "
          f"over their rows)")
    for paths, why in left:
        print(f"note: {source or 'the LoRA'}: {', '.join(paths)} stay separate adapters ({why})")


def check_lora_and_full(trainable_models, lora_base_model) -> None:
    """A model named by both --trainable_models and --lora_base_model: in the reference, adding the LoRA freezes the
    model's own weights again (peft marks only the adapter trainable), so the full training it asked for is dropped
    without a word and the checkpoint holds the LoRA alone. Refused here in one line instead."""
    given = _names(trainable_models)  # the flags' tuple or the API's "a,b"
    if lora_base_model and lora_base_model in given:
        raise UserError(f"--trainable_models {','.join(given)} with --lora_base_model {lora_base_model}: "
                        f"{lora_base_model} cannot be trained fully and through a LoRA at once (the reference "
                        f"trains the LoRA alone then); drop {lora_base_model} from one of the two flags")


def lora_prefix(pipe, slot: str) -> str:
    """The key prefix of `slot`'s LoRA in files: the family's, or the reference's default naming."""
    from ..lora import component_prefix

    family = getattr(pipe, "spec", None)
    return family.lora_prefix(slot) if family is not None else component_prefix(slot)


def lora_converters(pipe) -> tuple:
    """The family's translators for LoRA layouts only it has (FamilySpec.lora_converters)."""
    family = getattr(pipe, "spec", None)
    return family.lora_converters if family is not None else ()


class DiffusionTrainingModule(torch.nn.Module):
    """Base class: holds a pipeline; subclasses implement `forward(data) -> loss`."""

    def __init__(self):
        super().__init__()
        self.pipe = None
        self.lora_configs: dict[str, Any] = {}
        # The current sample's generator, from (seed, epoch, index): set by `difftune.launch_training_task`.
        self.generator: torch.Generator | None = None

    def _register_models(self, pipe) -> None:
        # The pipeline is not an nn.Module; registering its models makes .parameters(), DDP and
        # accelerate see them.
        self.pipe = pipe
        self.pipe_models = torch.nn.ModuleDict(pipe.loaded_models())

    def switch_pipe_to_training_mode(self, pipe, trainable_models=None, lora_base_model: str | None = None,
                                     lora_target_modules="", lora_rank: int = 32, lora_alpha: float | None = None,
                                     lora_checkpoint: str | None = None, preset_lora_path: str | None = None,
                                     preset_lora_model: str | None = None, inject_lora: bool = True,
                                     timestep_sampling: str = "uniform", timestep_shift: str = "fixed",
                                     loss_weighting: str = "bell",
                                     timestep_boundaries: tuple[float, float] = (0.0, 1.0),
                                     diffusion_options: dict | None = None) -> None:
        """Scheduler in training mode, freeze all but the trainable models, merge a preset LoRA, add the LoRA.

        Trainable weights are fp32 (frozen ones keep the pipeline dtype); mixed precision comes from accelerate.
        """
        from ..lora import fuse_lora, inject_lora as inject, load_lora_file, load_lora_into

        pipe.scheduler.set_training(sampling=timestep_sampling, shift=timestep_shift, weighting=loss_weighting,
                                    boundaries=timestep_boundaries, **(diffusion_options or {}))
        if inject_lora:
            check_lora_and_full(trainable_models, lora_base_model)
        for module in pipe.freeze_except(_names(trainable_models)):
            module.float()
        if preset_lora_path:
            if not preset_lora_model or pipe.models.get(preset_lora_model) is None:
                raise UserError(f"--preset_lora_model must name a loaded model (got {preset_lora_model!r})")
            preset = load_lora_file(preset_lora_path, converters=lora_converters(pipe))
            fuse_lora(pipe.models[preset_lora_model], preset,
                      component=lora_prefix(pipe, preset_lora_model))
        if lora_base_model and inject_lora:
            model = pipe.models.get(lora_base_model)
            if model is None:
                raise UserError(f"--lora_base_model {lora_base_model}: that model is not loaded "
                                f"(loaded: {sorted(pipe.loaded_models())})")
            from ..lora.auto_targets import AUTO, resolve_auto_targets

            if _names(lora_target_modules) == [AUTO]:
                lora_target_modules = resolve_auto_targets(model, lora_base_model)
            targets = lora_targets(pipe, lora_base_model, _names(lora_target_modules))
            if not targets:
                raise UserError("--lora_target_modules is empty: name the modules to put LoRA on, e.g. to_q,to_k,to_v")
            if lora_checkpoint:
                checkpoint = load_lora_file(lora_checkpoint, converters=lora_converters(pipe))
                config = load_lora_into(model, checkpoint, component=lora_prefix(pipe, lora_base_model),
                                        target_modules=targets, rank=lora_rank, alpha=lora_alpha)
            else:
                config = inject(model, targets, lora_rank, lora_alpha)
            share_fused_lora(pipe, lora_base_model, _names(lora_target_modules), source=lora_checkpoint)
            self.lora_configs[lora_base_model] = config
            model.train()
        self._register_models(pipe)

    def trainable_modules(self) -> list[torch.nn.Parameter]:
        return [p for p in self.parameters() if p.requires_grad]

    def trainable_param_names(self) -> list[str]:
        return [n for n, p in self.named_parameters() if p.requires_grad]


class PipelineTrainingModule(DiffusionTrainingModule):
    """Runs `units` on each sample, batches the results, and computes the task's loss.

    `from_cache=True` means samples are stage-1 values (no batch dimension) rather than raw data.
    """

    def __init__(self, pipe, task: str, units: Sequence, seed: int, settings: dict[str, Any] | None = None,
                 from_cache: bool = False):
        super().__init__()
        self.pipe = pipe
        self.task = task.split(":")[0]
        losses = all_losses(pipe.spec)
        if self.task not in losses:
            raise UserError(f"--task {task}: unknown task (known: {sorted(losses)})")
        self.loss = losses[self.task]
        self.loss_fn, self.loss_reads = self.loss.fn, pipe.loss_reads(self.loss.reads)
        self.units = list(units)
        self.seed = seed
        self.settings = dict(settings or {})
        self.from_cache = from_cache
        self.epoch = 0
        self.skipped: set[int] = set()  # dataset indices that failed to load (--on_bad_sample skip)
        self.stand_in = None  # set by fit.prepare under FSDP2 / ZeRO-3: (sample, index) to run instead of none
        self.attention_backend = "native"  # core.attention's name (--attention_backend, resolved for the device)

    @property
    def needed(self) -> tuple[str, ...]:
        names = tuple(self.loss_reads) + self.pipe.active_model_fn_inputs
        if self.loss.cfg:  # the negative side of what model_fn reads, too
            names += tuple(self.pipe.negative_name(n) for n in self.pipe.active_model_fn_inputs)
        return tuple(dict.fromkeys(names))

    def prepare_sample(self, sample: dict[str, Any], names: Sequence[str] | None = None) -> dict[str, Any]:
        """One sample through this module's units; returns what the loss needs (or `names`), no batch dimension."""
        from ..cache.codec import from_cache

        pipe = self.pipe
        if self.from_cache:
            cached = from_cache(sample)
            rules = pipe.batching
            values = collate_values([cached], rules)  # tensors (and declared lists) get their batch dimension back
            # Everything else stays as `training_inputs` gives it (height 32, not [32]), as in one-stage training.
            values.update({k: v for k, v in cached.items() if not isinstance(v, torch.Tensor) and rules.get(k) != LIST})
        else:
            values = pipe.training_inputs(sample)
        values.update(self.settings)
        pipe.run_units(values, self.units, cfg=self.loss.cfg)
        return split_batch(values, 1, pipe.batching, self.needed if names is None else names)[0]

    def forward(self, samples: list[dict[str, Any]], indices: Iterable[int], epoch: int | None = None):
        pipe = self.pipe
        epoch = self.epoch if epoch is None else epoch
        self.skipped.update(int(i) for s, i in zip(samples, indices) if s is None)
        kept = [(s, i) for s, i in zip(samples, indices) if s is not None]  # None: a skipped bad sample
        if not kept:
            if self.stand_in is not None:  # a sharded forward is collective: run one, on a good sample, weighted 0
                sample, index = self.stand_in()
                return self.forward([sample], [index], epoch) * 0.0
            # keep every parameter in the graph so DDP's gradient sync still happens
            return sum(p.sum() * 0.0 for p in self.trainable_modules())
        samples, indices = [s for s, _ in kept], [i for _, i in kept]
        prepared = [self.prepare_sample(s) for s in samples]
        batch = collate_values(prepared, pipe.batching, ids=[s.get("_id", i) for s, i in zip(samples, indices)])
        for key in getattr(pipe, "padding_masks", ()):
            if key in batch:
                batch[key] = unpadded(batch[key])  # looked at in host memory, before the transfer
        for key, value in batch.items():
            if isinstance(value, torch.Tensor):
                batch[key] = value.to(pipe.device)
        generators = [sample_generator(self.seed, epoch, int(i)) for i in indices]
        settings = {k: v for k, v in self.settings.items() if k in pipe.model_fn_settings}
        if self.attention_backend in NO_MASK:
            masked = [k for k in getattr(pipe, "padding_masks", ()) if batch.get(k) is not None]
            if masked:
                raise UserError(f"--attention_backend {self.attention_backend} takes no attention mask, and this "
                                f"batch's {masked[0]} pads (prompts of different lengths, or on the GPU): use "
                                f"--attention_backend native, or --batch_size 1 from a stage-1 cache")
        return self.loss_fn(pipe, batch, generators, settings)
