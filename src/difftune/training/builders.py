"""Plain builder functions a stage calls, each from the run: the data set, the pipeline with only the models the
stage uses, the training-mode arguments, the loop's configuration, resuming. Settings are read from the run
configuration here and nowhere else."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ..core.build import build_pipeline
from ..errors import UserError
from ..io import atomic_write_text
from .config import DEFAULT_DATA_FILE_KEYS


def stage_pipeline(run, wanted: set[str] | None):
    """The run's pipeline class with the models of the stage (`wanted`; None: all), its features fixed."""
    config = run.config
    return build_pipeline(run.family, run.models, device=run.accelerator.device, torch_dtype=config.torch_dtype,
                          wanted=wanted, features=run.features, pipeline=run.pipeline, options=config.family_options,
                          load_device="cpu" if config.initialize_model_on_cpu else None, detected=run.detected,
                          log=run.log)


def make_dataset(run):
    from ..data import UnifiedDataset

    config, family = run.config, run.family
    if not config.dataset_metadata_path:
        raise UserError("--dataset_metadata_path is required (only --task *:train reads a cache without metadata); "
                        "a folder of images with their caption files (kohya's layout) is read with "
                        "--dataset_metadata_path <that folder>")
    check_data_columns(config, run.pipeline, family.name)
    stream = run.pipeline.target.primary
    factor = stream.division
    height, width = rounded_size(config, factor, getattr(run, "log", print))
    size = dict(base_path=config.dataset_base_path, height=height, width=width,
                max_pixels=config.max_pixels, height_division_factor=factor, width_division_factor=factor)
    frames = config.frames
    operator = stream.operator(size, frames)
    # the target's other streams (a clip's sound) load through their own operators
    special = {**{s.column: s.operator(size, frames) for s in run.pipeline.target.streams[1:]},
               **run.pipeline.data_operators(config)} or None
    return UnifiedDataset(base_path=config.dataset_base_path, metadata_path=config.dataset_metadata_path,
                          repeat=config.dataset_repeat, data_file_keys=config.data_file_keys,
                          main_data_operator=operator, special_operator_map=special,
                          extra_inputs=config.extra_inputs,
                          on_bad_sample=config.on_bad_sample, present_keys_only=True,
                          allow_empty_prompts=config.allow_empty_prompts, progress=not config.no_progress,
                          frame_inputs=dict(stream.frame_inputs) if frames is not None else None,
                          paired_columns=run.pipeline.paired_columns(),
                          required_columns=run.pipeline.required_columns(run.features, config.extra_inputs),
                          allow_paths_outside=config.allow_paths_outside_dataset,
                          aligned_columns=run.pipeline.aligned_columns() if frames is not None else None,
                          clip_columns=stream.clip_columns, file_inputs=run.pipeline.file_columns(),
                          hidden_columns=unhanded_feature_columns(config, run.pipeline))


def unhanded_feature_columns(config, pipeline: type) -> tuple[str, ...]:
    """The features' columns a run does not hand its pipeline: every one --extra_inputs does not name (the reference's
    train.py hands --extra_inputs alone; one named only in --data_file_keys is loaded and ignored, with the note
    setup.unread_file_columns gives), save the pipeline's own inputs and its target's columns."""
    target = {c for s in pipeline.target.streams for c in (s.column, *s.clip_columns)}
    return tuple(c for c in pipeline.input_kinds()
                 if c not in config.extra_inputs and c not in pipeline.data_inputs and c not in target)


def rounded_size(config, factor: int, log=print) -> tuple[int | None, int | None]:
    """--height / --width rounded up to the family's division factor, as the reference's shape check does, with one
    note: the images are then cropped to that size (no stretch)."""
    sizes = {"height": config.height, "width": config.width}
    if config.height is None or config.width is None:
        return config.height, config.width
    rounded = {k: -(-int(v) // factor) * factor for k, v in sizes.items()}
    changed = [f"--{k} {sizes[k]} -> {rounded[k]}" for k in sizes if rounded[k] != sizes[k]]
    if changed:
        log(f"note: {', '.join(changed)} (a multiple of {factor}, the model's size factor, as the reference rounds "
            f"it); images are cropped to {rounded['width']}x{rounded['height']}, not stretched")
    return rounded["height"], rounded["width"]


def check_data_columns(config, pipeline: type, family: str) -> None:
    """A column named by --extra_inputs or --data_file_keys that no part of the pipeline reads would be loaded and
    dropped without a word: refuse it. (--data_file_keys' default, "image,video", names what may be there.)"""
    reads = pipeline.all_data_inputs()
    if not reads:
        return
    named = [("--extra_inputs", n) for n in config.extra_inputs]
    if config.data_file_keys != DEFAULT_DATA_FILE_KEYS:
        named += [("--data_file_keys", n) for n in config.data_file_keys]
    from .losses import UNREAD_INPUTS

    for name, why in UNREAD_INPUTS.get(config.task.split(":")[0], {}).items():
        if ("--extra_inputs", name) in named:
            named.remove(("--extra_inputs", name))
            print(f"note: --extra_inputs {name}: {why}")
    for flag, name in named:
        if name not in reads:
            raise UserError(f"{flag} {name}: the {family} family does not use an input called '{name}' "
                            f"(it reads {', '.join(reads)}), so it would be loaded and ignored")


def training_mode_kwargs(config) -> dict:
    """`switch_pipe_to_training_mode`'s arguments from the flags."""
    return dict(trainable_models=config.trainable_models, lora_base_model=config.lora_base_model,
                lora_target_modules=config.lora_target_modules, lora_rank=config.lora_rank,
                lora_alpha=config.lora_alpha, lora_checkpoint=config.lora_checkpoint,
                preset_lora_path=config.preset_lora_path, preset_lora_model=config.preset_lora_model,
                timestep_sampling=config.timestep_sampling, timestep_shift=config.timestep_shift,
                loss_weighting=config.loss_weighting,
                timestep_boundaries=(config.min_timestep_boundary, config.max_timestep_boundary),
                diffusion_options=diffusion_options(config))


def diffusion_options(config) -> dict:
    """kohya's loss options for epsilon / v-prediction models, as the scheduler takes them; only those set (a flow
    scheduler refuses any)."""
    given = {"noise_offset": config.noise_offset or None,
             "noise_offset_random_strength": config.noise_offset_random_strength or None,
             "min_snr_gamma": config.min_snr_gamma, "debiased_estimation_loss": config.debiased_estimation_loss or None,
             "min_timestep": config.min_timestep, "max_timestep": config.max_timestep}
    return {k: v for k, v in given.items() if v is not None}


def loop_config(config, resume_from=None):
    """The loop's configuration from the flags; `exactness` lists what an exact resume must find unchanged."""
    from .loop import LoopConfig

    if config.loss_readback_steps < 1:
        raise UserError(f"--loss_readback_steps must be at least 1 (got {config.loss_readback_steps})")
    return LoopConfig(
        learning_rate=config.learning_rate, weight_decay=config.weight_decay, num_epochs=config.num_epochs,
        max_steps=config.max_steps, batch_size=config.batch_size,
        gradient_accumulation_steps=config.gradient_accumulation_steps, max_grad_norm=config.max_grad_norm,
        lr_scheduler=config.lr_scheduler, lr_warmup_steps=config.lr_warmup_steps, seed=config.seed,
        num_workers=config.dataset_num_workers, customized_optimizer=config.customized_optimizer,
        optimizer_cpu_offload=bool(config.enable_optimizer_cpu_offload),
        progress=not config.no_progress, resume_from=resume_from, force_resume=config.force_resume,
        loss_readback_steps=config.loss_readback_steps, lora_compute=config.lora_compute,
        exactness={"task": config.task.split(":")[0], "trainable": config.trainable, "lora_rank": config.lora_rank,
                   "lora_target_modules": ",".join(config.lora_target_modules),  # its text, as runs saved it
                   "timestep_boundaries": [config.min_timestep_boundary, config.max_timestep_boundary]})


def find_resume(config, pipe):
    """`--resume_from_checkpoint`: a training state to continue exactly (returned), or full-model weights to
    start from (the reference's meaning: loaded into the pipeline here)."""
    value = config.resume_from_checkpoint
    if not value:
        return None
    if value != "latest" and not os.path.exists(value):
        raise UserError(f"--resume_from_checkpoint {value}: does not exist (give a training state folder, 'latest', "
                        f"or a .safetensors file of full-model weights)")
    if value == "latest" or os.path.isdir(value):
        from .state import find_state

        return find_state(value, config.output_path)
    load_full_weights(pipe, value, config.checkpoint_prefix((pipe.loss_models or (None,))[0]))
    return None


def load_full_weights(pipe, path: str, remove_prefix: str | None) -> None:
    """Full-model weights saved by a previous run, into the model `--remove_prefix_in_ckpt` names."""
    from safetensors.torch import load_file

    if not str(path).endswith(".safetensors"):
        raise UserError(f"--resume_from_checkpoint {path}: only .safetensors files are read (no pickles)")
    state = load_file(path)
    denoiser = (pipe.loss_models or ("dit",))[0]
    prefix = remove_prefix or f"pipe.{denoiser}."
    model_name = prefix.split(".")[1] if prefix.startswith("pipe.") else denoiser
    inner = prefix[len(f"pipe.{model_name}."):] if prefix.startswith("pipe.") else ""
    state = {inner + k: v for k, v in state.items()}  # e.g. pipe.blockwise_controlnet.models.0.: the rest goes back
    model = pipe.models.get(model_name)
    if model is None:
        raise UserError(f"--resume_from_checkpoint {path}: model '{model_name}' is not loaded")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        raise UserError(f"--resume_from_checkpoint {path}: keys that {model_name} does not have, e.g. {unexpected[0]}")


def write_json(path: Path, data) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, default=str))


def bad_samples_of_all_processes(accelerator, bad: list[dict]) -> list[dict]:
    """A row that fails to decode is found by the process that loads it: collect every process's finds
    (a collective call: every process must make it), one entry per sample id, in row order."""
    if accelerator.num_processes > 1:
        from accelerate.utils import gather_object

        bad = gather_object(list(bad))
    unique: dict = {}
    for entry in bad:  # an entry with the row number beats a bare "failed to load" for the same id
        key = entry.get("id", json.dumps(entry, sort_keys=True, default=str))
        if key not in unique or ("row" in entry and "row" not in unique[key]):
            unique[key] = entry
    return sorted(unique.values(), key=lambda e: (e.get("row") is None, e.get("row") or 0, str(e.get("id"))))


__all__ = ["bad_samples_of_all_processes", "check_data_columns", "find_resume", "load_full_weights", "loop_config",
           "make_dataset", "stage_pipeline", "training_mode_kwargs", "write_json"]
