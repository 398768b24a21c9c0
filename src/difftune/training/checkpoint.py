"""Saving what was trained: LoRA files that diffusers, ComfyUI and the reference load, full models with official keys.

A LoRA is saved in the layout the run resolved (`stages.lora_format`: by default the family's, which diffusers'
`load_lora_weights`, ComfyUI and DiffSynth-Studio's loader all read at the trained strength; docs/lora_files.md):
"diffusers" (`transformer.<module>.lora_A.weight`, alpha/rank folded into lora_B, the trained alpha in difftune's
metadata), "comfyui" / "kohya" (with `.alpha` tensors). A fully trained model is saved with the
reference's naming (`pipe.<model>.<key>`) minus `--remove_prefix_in_ckpt`; the default, `pipe.<the denoiser's
slot>.` (`pipe.dit.` for a DiT, as the reference's scripts give it), leaves the official diffusers key names, so the
file loads into the denoiser's diffusers class. Every file is written to a temporary name and renamed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from ..version import __version__
from ..errors import UserError
from ..io import atomic_save_safetensors, atomic_write_text
from .loop import Hooks, LoopState

def _split_by_model(state: dict[str, torch.Tensor], names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Trainable entries of the module's state dict, grouped by pipeline model, keyed inside the model."""
    per_model: dict[str, dict[str, torch.Tensor]] = {}
    for name in names:
        if not name.startswith("pipe_models."):
            continue
        model, _, key = name[len("pipe_models."):].partition(".")
        per_model.setdefault(model, {})[key] = state[name]
    return per_model


class CheckpointSaver:
    """Writes `<output_path>/<name>.safetensors` (and `<name>-<model>.safetensors` for extra full models)."""

    def __init__(self, output_path: str, remove_prefix: str | None = "pipe.dit.", base_info: dict | None = None,
                 lora_prefixes: dict[str, str] | None = None, lora_format: str = "default",
                 denoiser: str | None = None, native_names=None, full_converters: dict | None = None,
                 reference_names=None):
        self.output_path = Path(output_path)
        self.remove_prefix = remove_prefix or ""
        self.base_info = base_info or {}
        self.lora_prefixes = dict(lora_prefixes or {})  # slot -> key prefix in the LoRA file (the family's)
        self.lora_format, self.denoiser = lora_format, denoiser  # denoiser: the slot ComfyUI/kohya names
        self.native_names = native_names  # the family's lora_native_names, for those two layouts
        self.reference_names = reference_names  # the family's lora_reference_names (the reference layout)
        self.full_converters = dict(full_converters or {})  # slot -> state dict renamer (--full_format original)
        self.saved: list[Path] = []

    def save(self, accelerator, module, name: str) -> list[Path]:
        from .engines import trained_state_dict

        accelerator.wait_for_everyone()
        state = trained_state_dict(accelerator, module)  # each sharded weight gathered whole (FSDP2 / ZeRO)
        inner = accelerator.unwrap_model(module)
        written: list[Path] = []
        if accelerator.is_main_process:
            written = self.write(inner, state, name)
        accelerator.wait_for_everyone()
        return written

    def write(self, inner, state: dict[str, torch.Tensor], name: str) -> list[Path]:
        from ..lora import canonical_lora_keys, expand_shared_lora, save_lora

        per_model = _split_by_model(state, [n for n in inner.trainable_param_names() if n in state])
        models = getattr(inner, "pipe_models", None) or {}
        # an adapter shared by several layers (the reference's fused q/k/v) is written as each layer's LoRA
        lora = {m: expand_shared_lora(models[m], sd) if m in models else sd
                for m, sd in per_model.items() if m in inner.lora_configs}
        full = {m: sd for m, sd in per_model.items() if m not in inner.lora_configs}
        written = []
        if lora:
            path = self.output_path / f"{name}.safetensors"
            layout, prefixes, denoiser, native = self.lora_format, self.lora_prefixes, self.denoiser, self.native_names
            reference = self.reference_names
            if layout == "default":  # a script's ModelLogger: the family's layout, as the train command writes it
                family = getattr(getattr(inner, "pipe", None), "spec", None)
                denoiser = denoiser or (getattr(inner.pipe, "loss_models", None) or (None,))[0]
                own = getattr(inner.pipe, "lora_default_format", None)
                layout = (own or family.lora_default_format) if family is not None and set(lora) == {denoiser} \
                    else "diffusers"
                if family is not None:
                    prefixes = prefixes or dict(family.lora_prefixes)
                    native = native or family.lora_native_names
                    reference = reference or family.lora_reference_names
            save_lora(path, {m: canonical_lora_keys(sd) for m, sd in lora.items()},
                      {m: inner.lora_configs[m] for m in lora}, base_info=self.base_info, prefixes=prefixes,
                      layout=layout, denoiser=denoiser, native_names=native, reference_names=reference)
            written.append(path)
        for model, sd in full.items():
            if model in self.full_converters:
                sd = self.full_converters[model](sd)
            prefixed = {f"pipe.{model}.{k}": v for k, v in sd.items()}
            out = {(k[len(self.remove_prefix):] if self.remove_prefix and k.startswith(self.remove_prefix) else k): v
                   for k, v in prefixed.items()}
            single = not lora and len(full) == 1
            path = self.output_path / (f"{name}.safetensors" if single else f"{name}-{model}.safetensors")
            meta = {"format": "pt", "difftune_version": __version__, "difftune_model": model,
                    "difftune_base": json.dumps(self.base_info)}
            atomic_save_safetensors(out, path, metadata=meta)
            written.append(path)
        self.saved.extend(written)
        return written


class ModelLogger(CheckpointSaver):
    """The reference's name, for training scripts: saves what is trained, `<output_path>/epoch-<i>.safetensors`
    after each epoch, or `step-<n>.safetensors` every `save_steps` optimizer steps (and at the end).

    A LoRA is written in the family's default layout, as the `train` command writes it (loads with `pipe.load_lora`,
    diffusers, ComfyUI and DiffSynth-Studio: docs/lora_files.md); fully trained
    models with the keys `pipe.<model>.<key>` minus `remove_prefix_in_ckpt`.
    """

    def __init__(self, output_path: str, remove_prefix_in_ckpt: str | None = "pipe.dit.",
                 save_steps: int | None = None):
        super().__init__(output_path, remove_prefix_in_ckpt)
        if save_steps is not None and int(save_steps) < 1:
            raise UserError(f"save_steps must be a positive number of optimizer steps, got {save_steps}")
        self.save_steps = int(save_steps) if save_steps else None

    def save(self, accelerator, module, name: str):
        from ..core.family import families

        pipe = getattr(accelerator.unwrap_model(module), "pipe", None)
        family = families().get(getattr(pipe, "family", None))
        self.base_info = {"family": getattr(pipe, "family", None), "script": "difftune.api"}
        if family is not None:
            self.lora_prefixes = dict(family.lora_prefixes)
        return super().save(accelerator, module, name)


class CsvLog:
    """`<output_path>/loss.csv`: step, epoch, loss, lr per optimizer step (main process). A resumed run keeps
    the rows up to the step it resumes from and appends.

    Rows are held in memory until `commit()` (called once the run's first checkpoint, state or validation
    image is saved), so a run that fails before saving anything leaves an earlier loss.csv as it was."""

    HEADER = "step,epoch,loss,lr\n"

    def __init__(self, path: str | os.PathLike, resume_step: int = 0):
        self.path = Path(path)
        self.resume_step = resume_step
        self.pending: list[str] = []
        self.committed = False

    def commit(self) -> None:
        if self.committed:
            return
        kept = []
        if self.resume_step and self.path.is_file():
            for line in self.path.read_text().splitlines()[1:]:
                step = line.split(",", 1)[0]
                if step.isdigit() and int(step) <= self.resume_step:
                    kept.append(line + "\n")
        atomic_write_text(self.path, self.HEADER + "".join(kept) + "".join(self.pending))
        self.pending, self.committed = [], True

    def write(self, step: int, epoch: int, loss: float, lr: float) -> None:
        row = f"{step},{epoch},{loss:.8g},{lr:.8g}\n"
        if not self.committed:
            self.pending.append(row)
            return
        with open(self.path, "a") as f:
            f.write(row)


class RunHooks(Hooks):
    """When to save checkpoints and training states, render validation samples and log rows: one place.

    Checkpoints: every `save_steps` optimizer steps (and at the end), else after every epoch. States:
    every `save_state_steps`, and with every checkpoint when `save_state`. Validation: every
    `validation_steps` and at the end. Stopped by a signal: a checkpoint `step-<n>` and, when states are saved,
    a state. Once the run's first checkpoint, state or validation image is in the output folder, `record` (a
    `run_lock.RunRecord`) becomes the folder's `training_args.json` and the CSV log is written.
    """

    def __init__(self, saver: CheckpointSaver | None = None, save_steps: int | None = None,
                 state_dir: str | None = None, save_state_steps: int | None = None, save_state: bool = False,
                 keep_states: int = 2, validate=None, validation_steps: int | None = None, csv: CsvLog | None = None,
                 record=None):
        self.saver, self.save_steps = saver, save_steps
        self.state_dir, self.save_state_steps, self.save_state, self.keep_states = \
            state_dir, save_state_steps, save_state, keep_states
        self.validate, self.validation_steps, self.csv, self.record = validate, validation_steps, csv, record
        self.checkpoint_step = self.state_step = None  # the step of the last checkpoint / state saved
        self.last_state = None

    def _first_write(self) -> None:
        if self.record is not None:
            self.record.promote()
        if self.csv is not None:
            self.csv.commit()

    def _checkpoint(self, state: LoopState, name: str) -> None:
        if self.saver is not None:
            state.flush()  # the losses so far are read back and checked before anything is saved
            self.saver.save(state.accelerator, state.module, name)
            self._first_write()
            self.checkpoint_step = state.step
            if self.save_state:
                self._state(state)

    def _state(self, state: LoopState) -> None:
        from .state import save_training_state

        state.flush()
        self.last_state = save_training_state(
            state.accelerator, state.module, state.optimizer, state.schedule,
            {"global_step": state.step, "epoch": state.epoch, "step_in_epoch": state.step_in_epoch},
            state.exactness, self.state_dir, keep=self.keep_states)
        self.state_step = state.step
        self._first_write()

    def _validate(self, state: LoopState) -> None:
        state.flush()
        self.validate(state.accelerator, state.inner, state.step)
        self._first_write()

    def log_losses(self, state: LoopState, rows) -> None:
        if self.csv is not None and state.accelerator.is_main_process:
            for step, epoch, loss, lr in rows:
                self.csv.write(step, epoch, loss, lr)

    def after_step(self, state: LoopState, loss: float | None, lr: float) -> None:
        checkpoint = bool(self.save_steps) and state.step % self.save_steps == 0
        if checkpoint:
            self._checkpoint(state, f"step-{state.step}")
        if self.save_state_steps and state.step % self.save_state_steps == 0 and not (checkpoint and self.save_state):
            self._state(state)
        if self.validate is not None and self.validation_steps and state.step % self.validation_steps == 0:
            self._validate(state)

    def after_epoch(self, state: LoopState) -> None:
        if not self.save_steps:
            self._checkpoint(state, f"epoch-{state.epoch}")

    def at_end(self, state: LoopState) -> None:
        if self.save_steps and state.step % self.save_steps != 0:
            self._checkpoint(state, f"step-{state.step}")
        if self.validate is not None and (not self.validation_steps or state.step % self.validation_steps != 0):
            self._validate(state)
        self._first_write()  # a run that saved nothing still ends with its record and CSV log

    def on_stop(self, state: LoopState) -> None:
        if self.checkpoint_step != state.step:
            self._checkpoint(state, f"step-{state.step}")
        if (self.save_state_steps or self.save_state) and self.state_step != state.step and self.state_dir:
            self._state(state)

    def last_checkpoint(self):
        return self.saver.saved[-1] if (self.saver is not None and self.saver.saved) else None
