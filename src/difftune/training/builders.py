"""Plain builder functions the `train` recipe calls, each from the flags: the task, the accelerator, the
family and its models, the pipeline with only the models a stage uses, the split, the data set, the loop's
configuration. Settings are read from the flags here and nowhere else."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..core.family import FamilySpec, recognise
from ..core.graph import split_units
from ..errors import UserError
from ..io import atomic_write_text
from ..util import names, torch_dtype
from .losses import LOSSES



@dataclass
class TaskSpec:
    loss: str  # sft | direct_distill
    stage: str  # "" (one stage) | data_process | train | split

    @classmethod
    def parse(cls, task: str) -> TaskSpec:
        loss, _, stage = task.partition(":")
        if loss not in LOSSES or stage not in ("", "data_process", "train", "split"):
            raise UserError(f"--task {task}: unknown task")
        return cls(loss, stage)


def trainable_set(args) -> list[str]:
    return names([*names(args.trainable_models), args.lora_base_model])


def reset_accelerate_state() -> None:
    """Forget accelerate's process-global state, so the next Accelerator in this process starts clean (as a
    separate command would): for running several trainings in one process (the demo, tests, benchmarks)."""
    from accelerate.state import AcceleratorState, GradientState, PartialState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    PartialState._reset_state()


def make_accelerator(args, project_dir: str | None):
    from accelerate import Accelerator, DistributedDataParallelKwargs
    from accelerate.utils import ProjectConfiguration

    mixed = args.mixed_precision
    if mixed is None:
        mixed = "bf16" if args.torch_dtype == "bfloat16" else "fp16" if args.torch_dtype == "float16" else "no"
    log_with = []
    if project_dir and args.enable_tensorboard_log:
        log_with.append("tensorboard")
    config = ProjectConfiguration(project_dir=project_dir, logging_dir=os.path.join(project_dir, "logs")) \
        if project_dir else None
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),  # gloo DDP on CPU under `accelerate launch --multi_gpu`
        gradient_accumulation_steps=args.gradient_accumulation_steps, mixed_precision=mixed,
        log_with=log_with or None, project_config=config,
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=bool(args.find_unused_parameters))],
    )
    # A DeepSpeed accelerate config's gradient_accumulation_steps arrives through the environment and beats
    # the argument above; the sampler and step counts follow the flag, so a mismatch would go wrong silently.
    if accelerator.gradient_accumulation_steps != args.gradient_accumulation_steps:
        raise UserError(f"the accelerate config sets gradient_accumulation_steps to "
                        f"{accelerator.gradient_accumulation_steps} but --gradient_accumulation_steps is "
                        f"{args.gradient_accumulation_steps}: remove it from the config (the flag decides)")
    return accelerator


def main_process_log(accelerator):
    return print if accelerator.is_main_process else (lambda *a, **k: None)


def resolve_models(args, log=print) -> tuple[FamilySpec, list]:
    """The family (`--family`, else recognised from the weights) and (slot, ModelConfig) for every model flag
    entry. `--fp8_models` may name slots, so it is applied once the family is known."""
    from ..models import check_fp8_slots, parse_model_configs

    configs = parse_model_configs(args.model_paths, args.model_id_with_origin_paths, args.fp8_models,
                                  quant_options=getattr(args, "quant_options", None))
    family, recognised = recognise(configs, args.family, log=log)
    check_fp8_slots(configs, family.slots)
    return family, [(slot, config) for slot, config, _ in recognised]


def build_pipeline(family: FamilySpec, args, models, wanted: set[str] | None, device, log=print):
    """The family's pipeline with the models of `models` whose slot is in `wanted` (None: all), and the
    tokenizers/processors those models need."""
    from ..models import load_component

    dtype = torch_dtype(args.torch_dtype)
    pipe = family.pipeline(device=device, torch_dtype=dtype)
    for slot, config in models:
        if wanted is not None and slot not in wanted:
            log(f"not loading {slot} ({config.describe()}): this stage does not use it")
            continue
        loaded = load_component(config, family.components, torch_dtype=dtype,
                                device="cpu" if args.initialize_model_on_cpu else device)
        setattr(pipe, slot, loaded.module)
    for tok in family.tokenizers:
        if pipe.models.get(tok.slot) is None:
            continue
        needed = tok.needed(args) if tok.needed is not None else True
        given = getattr(args, tok.flag, None) if tok.flag else None
        if given and not os.path.exists(given) and ":" in given:  # model_id:folder/, as the reference's flags take
            given = _hub_folder(given)
        where = given or _beside(models, tok, download=needed)
        if where is None and needed and tok.default:
            where = _hub_folder(tok.default)
        if where is None:
            if tok.required:
                flag = f"pass --{tok.flag} " if tok.flag else ""
                raise UserError(f"no {tok.attr} found: {flag}(looked for a {tok.folder}/ folder beside the "
                                f"{tok.slot} weights)")
            continue
        setattr(pipe, tok.attr, tok.load(where))
    return pipe


def _hub_folder(location: str):
    from ..models import ModelConfig

    model_id, _, folder = location.partition(":")
    return ModelConfig(model_id=model_id, origin_file_pattern=folder)


def _beside(models, tok, download: bool):
    """The official layout keeps tokenizer/ (and processor/) beside the model's folder; for a hub id, the same
    repository's folder (downloaded like the weights, if `download` and the family names no other place for it,
    as Qwen-Image-Edit's processor, which the reference takes from Qwen/Qwen-Image-Edit)."""
    from ..models import ModelConfig

    for slot, config in models:
        if slot != tok.slot:
            continue
        if config.model_id and download and tok.default is None:
            return ModelConfig(model_id=config.model_id, origin_file_pattern=f"{tok.folder}/",
                               local_model_path=config.local_model_path, download_source=config.download_source,
                               skip_download=config.skip_download)
        files = config.resolve()
        first = Path(files[0] if isinstance(files, (list, tuple)) else files)
        candidate = (first if first.is_dir() else first.parent).parent / tok.folder
        if candidate.is_dir():
            return str(candidate)
    return None


def stage_settings(args, family: FamilySpec) -> dict:
    """Run-time settings every stage passes to its units and the loss (never cached)."""
    settings = {"use_gradient_checkpointing": bool(args.use_gradient_checkpointing),
                "use_gradient_checkpointing_offload": bool(args.use_gradient_checkpointing_offload), "batch_size": 1}
    if family.flag_settings is not None:
        settings.update(family.flag_settings(args))
    return settings


def compute_split(family: FamilySpec, args, task: TaskSpec):
    pipe_cls = family.pipeline
    loss_reads = LOSSES[task.loss][1] + pipe_cls.model_fn_inputs
    return split_units(pipe_cls().units, trainable_set(args), loss_reads, settings=pipe_cls.settings,
                       loss_models=pipe_cls.loss_models)


def frame_settings(args, family: FamilySpec) -> dict | None:
    """A video family's frame settings from the flags (None for an image family): `num_frames` (the family's
    default where --num_frames is not given) and the time division clips are cut to. Refuses --num_frames
    for an image family, and a count the family's VAE cannot take, in one line."""
    pipe = family.pipeline
    if family.data != "video":
        for flag in ("num_frames", "validation_num_frames"):
            if getattr(args, flag, None) is not None:
                raise UserError(f"--{flag}: not used: the {family.name} family trains on images "
                                f"(--{flag} is for video families)")
        return None
    factor, remainder = pipe.time_division_factor, pipe.time_division_remainder
    num_frames = args.num_frames if getattr(args, "num_frames", None) is not None else pipe.default_num_frames
    checked = (("num_frames", num_frames), ("validation_num_frames", getattr(args, "validation_num_frames", None)))
    for flag, value in checked:
        if value is not None and (value < 1 or value % factor != remainder % factor):
            examples = ", ".join(str(remainder + factor * k) for k in range(4) if remainder + factor * k >= 1)
            raise UserError(f"--{flag} {value}: the {family.name} family takes {factor}k+{remainder} frames "
                            f"({examples}, ...)")
    return {"num_frames": int(num_frames), "time_division_factor": factor, "time_division_remainder": remainder}


def make_dataset(args, family: FamilySpec):
    from ..data import UnifiedDataset

    if not args.dataset_metadata_path:
        raise UserError("--dataset_metadata_path is required (only --task *:train reads a cache without metadata)")
    if family.data not in ("image", "video"):
        raise UserError(f"the {family.name} family reads {family.data} data, which this difftune cannot load")
    check_data_columns(args, family)
    factor = family.pipeline.division_factor
    size = dict(base_path=args.dataset_base_path, height=args.height, width=args.width, max_pixels=args.max_pixels,
                height_division_factor=factor, width_division_factor=factor)
    frames = frame_settings(args, family)
    operator = (UnifiedDataset.default_video_operator(**size, **frames) if frames is not None
                else UnifiedDataset.default_image_operator(**size))
    special = dict(family.data_operators(args)) if family.data_operators is not None else None
    return UnifiedDataset(base_path=args.dataset_base_path, metadata_path=args.dataset_metadata_path,
                          repeat=args.dataset_repeat, data_file_keys=names(args.data_file_keys),
                          main_data_operator=operator, special_operator_map=special,
                          extra_inputs=names(args.extra_inputs),
                          on_bad_sample=args.on_bad_sample, present_keys_only=True,
                          allow_empty_prompts=args.allow_empty_prompts, progress=not args.no_progress,
                          frame_inputs=dict(family.pipeline.frame_inputs) if frames is not None else None)


def check_data_columns(args, family: FamilySpec) -> None:
    """A column named by --extra_inputs or --data_file_keys that the family never reads would be loaded and
    dropped without a word: refuse it. (--data_file_keys' default, "image,video", names what may be there.)"""
    reads = family.pipeline.data_inputs
    if not reads:
        return
    named = [("--extra_inputs", n) for n in names(args.extra_inputs)]
    if args.data_file_keys != DEFAULT_DATA_FILE_KEYS:
        named += [("--data_file_keys", n) for n in names(args.data_file_keys)]
    from .losses import UNREAD_INPUTS

    for name, why in UNREAD_INPUTS.get((getattr(args, "task", "") or "").split(":")[0], {}).items():
        if ("--extra_inputs", name) in named:
            named.remove(("--extra_inputs", name))
            print(f"note: --extra_inputs {name}: {why}")
    for flag, name in named:
        if name not in reads:
            raise UserError(f"{flag} {name}: the {family.name} family does not use an input called '{name}' "
                            f"(it reads {', '.join(reads)}), so it would be loaded and ignored")


DEFAULT_DATA_FILE_KEYS = "image,video"


def ensure_writable(path: str, flag: str = "--output_path") -> None:
    """Fail before any work if the output directory cannot be created or written."""
    import tempfile

    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".difftune-write-test-"):
            pass
    except OSError as err:
        raise UserError(f"{flag} {path}: cannot write there ({err.strerror or err})") from None


def training_mode_kwargs(args) -> dict:
    """`switch_pipe_to_training_mode`'s arguments from the flags."""
    return dict(trainable_models=args.trainable_models, lora_base_model=args.lora_base_model,
                lora_target_modules=args.lora_target_modules, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
                lora_checkpoint=args.lora_checkpoint, preset_lora_path=args.preset_lora_path,
                preset_lora_model=args.preset_lora_model, timestep_sampling=args.timestep_sampling,
                timestep_shift=args.timestep_shift, loss_weighting=args.loss_weighting,
                timestep_boundaries=(args.min_timestep_boundary, args.max_timestep_boundary))


def loop_config(args, resume_from=None):
    """The loop's configuration from the flags; `exactness` lists what an exact resume must find unchanged."""
    from .loop import LoopConfig

    return LoopConfig(
        learning_rate=args.learning_rate, weight_decay=args.weight_decay, num_epochs=args.num_epochs,
        max_steps=args.max_steps, batch_size=args.batch_size, gradient_accumulation_steps=args.gradient_accumulation_steps,
        max_grad_norm=args.max_grad_norm, lr_scheduler=args.lr_scheduler, lr_warmup_steps=args.lr_warmup_steps,
        seed=args.seed, num_workers=args.dataset_num_workers, customized_optimizer=args.customized_optimizer,
        progress=not args.no_progress, resume_from=resume_from, force_resume=args.force_resume,
        exactness={"task": args.task.split(":")[0], "trainable": trainable_set(args), "lora_rank": args.lora_rank,
                   "lora_target_modules": args.lora_target_modules,
                   "timestep_boundaries": [args.min_timestep_boundary, args.max_timestep_boundary]})


def find_resume(args, pipe):
    """`--resume_from_checkpoint`: a training state to continue exactly (returned), or full-model weights to
    start from (the reference's meaning: loaded into the pipeline here)."""
    value = args.resume_from_checkpoint
    if not value:
        return None
    if value == "latest" or os.path.isdir(value):
        from .state import find_state

        return find_state(value, args.output_path)
    load_full_weights(pipe, value, args.remove_prefix_in_ckpt)
    return None


def load_full_weights(pipe, path: str, remove_prefix: str | None) -> None:
    """Full-model weights saved by a previous run, into the model `--remove_prefix_in_ckpt` names."""
    from safetensors.torch import load_file

    if not str(path).endswith(".safetensors"):
        raise UserError(f"--resume_from_checkpoint {path}: only .safetensors files are read (no pickles)")
    state = load_file(path)
    prefix = remove_prefix or "pipe.dit."
    model_name = prefix.split(".")[1] if prefix.startswith("pipe.") else "dit"
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
