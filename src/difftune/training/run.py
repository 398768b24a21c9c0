"""The `train` command: flags -> accelerator, pipeline, data, module -> one of the tasks.

Tasks: `sft` / `direct_distill` train in one stage; `<task>:data_process` runs stage 1 and writes the
cache; `<task>:train` trains from a cache; `<task>:split` does both in one command, freeing the
stage-1 models before stage 2. Each stage loads only the models it uses, whatever the model flags list.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UserError
from ..io import atomic_write_text
from ..pipelines import families, get_family, split_units
from .losses import LOSSES

DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


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


def _names(value) -> list[str]:
    return [v.strip() for v in (value or "").split(",") if v.strip()]


def trainable_set(args) -> list[str]:
    names = _names(args.trainable_models)
    if args.lora_base_model:
        names.append(args.lora_base_model)
    return list(dict.fromkeys(names))


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
    log_with = "tensorboard" if (project_dir and args.enable_tensorboard_log) else None
    config = ProjectConfiguration(project_dir=project_dir, logging_dir=os.path.join(project_dir, "logs")) \
        if project_dir else None
    accelerator = Accelerator(
        cpu=not torch.cuda.is_available(),  # gloo DDP on CPU under `accelerate launch --multi_gpu`
        gradient_accumulation_steps=args.gradient_accumulation_steps, mixed_precision=mixed,
        log_with=log_with, project_config=config,
        kwargs_handlers=[DistributedDataParallelKwargs(find_unused_parameters=bool(args.find_unused_parameters))],
    )
    # A DeepSpeed accelerate config's gradient_accumulation_steps arrives through the environment and beats
    # the argument above; the sampler and step counts follow the flag, so a mismatch would go wrong silently.
    if accelerator.gradient_accumulation_steps != args.gradient_accumulation_steps:
        raise UserError(f"the accelerate config sets gradient_accumulation_steps to "
                        f"{accelerator.gradient_accumulation_steps} but --gradient_accumulation_steps is "
                        f"{args.gradient_accumulation_steps}: remove it from the config (the flag decides)")
    return accelerator


def resolve_components(args):
    """(component name, ModelConfig) for every model flag entry, recognised from the weights' headers."""
    from ..models import detect_component, parse_model_configs

    configs = parse_model_configs(args.model_paths, args.model_id_with_origin_paths, args.fp8_models)
    return [(detect_component(c).name, c) for c in configs]


def build_pipeline(args, components, wanted: set[str] | None, device, log=print):
    from ..models import load_component, load_processor, load_tokenizer

    family = args.family or "qwen_image"
    cls = families().get(family)
    if cls is None:
        raise UserError(f"--family {family}: unknown family (known: {sorted(families())})")
    dtype = DTYPES[args.torch_dtype]
    pipe = cls(device=device, torch_dtype=dtype)
    for name, config in components:
        if wanted is not None and name not in wanted:
            log(f"not loading {name} ({config.describe()}): this stage does not use it")
            continue
        loaded = load_component(config, torch_dtype=dtype, device="cpu" if args.initialize_model_on_cpu else device)
        setattr(pipe, loaded.name, loaded.module)
    needs_text = wanted is None or "text_encoder" in wanted
    if needs_text and pipe.models.get("text_encoder") is not None:
        pipe.tokenizer = load_tokenizer(args.tokenizer_path or _sibling(components, "text_encoder", "tokenizer"))
        wants_edit = "edit_image" in _names(getattr(args, "extra_inputs", None)) or getattr(args, "edit_image", None)
        processor = args.processor_path or _sibling(components, "text_encoder", "processor", required=False,
                                                    download=bool(wants_edit))
        if processor:
            pipe.processor = load_processor(processor)
    return pipe


def _sibling(components, component: str, folder: str, required: bool = True, download: bool = True):
    """The official layout keeps tokenizer/ (and processor/) beside text_encoder/; for a hub id, the same
    repository's folder (downloaded like the weights)."""
    from ..models import ModelConfig

    for name, config in components:
        if name != component:
            continue
        if config.model_id and download:
            return ModelConfig(model_id=config.model_id, origin_file_pattern=f"{folder}/",
                               local_model_path=config.local_model_path, download_source=config.download_source,
                               skip_download=config.skip_download)
        files = config.resolve()
        first = Path(files[0] if isinstance(files, (list, tuple)) else files)
        candidate = (first if first.is_dir() else first.parent).parent / folder
        if candidate.is_dir():
            return str(candidate)
    if required:
        raise UserError(f"no tokenizer found: pass --tokenizer_path (looked for a {folder}/ folder beside the text encoder)")
    return None


def stage_settings(args) -> dict:
    return {"use_gradient_checkpointing": bool(args.use_gradient_checkpointing),
            "use_gradient_checkpointing_offload": bool(args.use_gradient_checkpointing_offload),
            "edit_image_auto_resize": bool(getattr(args, "edit_image_auto_resize", True)), "batch_size": 1}


def compute_split(pipe_cls, args, task: TaskSpec):
    loss_reads = LOSSES[task.loss][1] + pipe_cls.model_fn_inputs
    return split_units(pipe_cls().units, trainable_set(args), loss_reads, settings=pipe_cls.settings,
                       loss_models=pipe_cls.loss_models)


def make_dataset(args, pipe_cls):
    from ..data import UnifiedDataset

    if not args.dataset_metadata_path:
        raise UserError("--dataset_metadata_path is required (only --task *:train reads a cache without metadata)")
    keys = _names(args.data_file_keys)
    extra = _names(args.extra_inputs)
    operator = UnifiedDataset.default_image_operator(
        base_path=args.dataset_base_path, height=args.height, width=args.width, max_pixels=args.max_pixels,
        height_division_factor=pipe_cls.division_factor, width_division_factor=pipe_cls.division_factor)
    return UnifiedDataset(base_path=args.dataset_base_path, metadata_path=args.dataset_metadata_path,
                          repeat=args.dataset_repeat, data_file_keys=keys, main_data_operator=operator,
                          extra_inputs=extra, on_bad_sample=args.on_bad_sample, present_keys_only=True)


def run(args) -> dict:
    task = TaskSpec.parse(args.task)
    if task.stage == "split":
        from .split import run_split

        return run_split(args, task)
    if task.stage == "data_process":
        from .split import run_data_process

        return run_data_process(args, task)
    return run_train(args, task)


def run_train(args, task: TaskSpec, accelerator=None) -> dict:
    from .checkpoint import CheckpointSaver
    from .loop import LoopConfig, train
    from .module import PipelineTrainingModule

    ensure_writable(args.output_path)
    accelerator = accelerator or make_accelerator(args, args.output_path)
    log = print if accelerator.is_main_process else (lambda *a, **k: None)
    pipe_cls = get_family(args.family)
    split = compute_split(pipe_cls, args, task)
    components = resolve_components(args)
    from_cache = task.stage == "train"
    if from_cache:
        from .split import open_cache

        dataset = open_cache(args, pipe_cls, split)
        wanted = set(split.stage2_models)
        units = split.stage2
        log(f"training from the cache at {args.dataset_base_path} ({len(dataset)} samples): {split.describe()}")
    else:
        dataset = make_dataset(args, pipe_cls)
        wanted = None
        units = pipe_cls().units
    from ..models import check_fp8_frozen

    check_fp8_frozen([n for n, c in components if c.wants_fp8(n)], args.trainable_models)
    pipe = build_pipeline(args, components, wanted, accelerator.device, log=log)
    if from_cache:  # this stage's units, bound to this pipeline's instances
        units = [u for u in pipe.units if type(u) in {type(s) for s in split.stage2}]
    module = PipelineTrainingModule(pipe, task.loss, units, seed=args.seed, settings=stage_settings(args),
                                    from_cache=from_cache)
    resume_state = None
    if args.resume_from_checkpoint:
        if args.resume_from_checkpoint == "latest" or os.path.isdir(args.resume_from_checkpoint):
            from .state import find_state

            resume_state = find_state(args.resume_from_checkpoint, args.output_path)
        else:
            load_full_weights(pipe, args.resume_from_checkpoint, args.remove_prefix_in_ckpt)
    # LoRA initialisation draws from the global RNG: seed it here so the initial weights depend only on
    # --seed (and not on which models this stage happened to load before).
    torch.manual_seed(args.seed)
    module.switch_pipe_to_training_mode(
        pipe, trainable_models=args.trainable_models, lora_base_model=args.lora_base_model,
        lora_target_modules=args.lora_target_modules, lora_rank=args.lora_rank, lora_alpha=args.lora_alpha,
        lora_checkpoint=args.lora_checkpoint, preset_lora_path=args.preset_lora_path,
        preset_lora_model=args.preset_lora_model, timestep_sampling=args.timestep_sampling,
        timestep_shift=args.timestep_shift, loss_weighting=args.loss_weighting)
    os.makedirs(args.output_path, exist_ok=True)
    if accelerator.is_main_process:
        _write_json(Path(args.output_path) / "training_args.json", vars(args))
    if accelerator.log_with:
        accelerator.init_trackers("train")
    saver = CheckpointSaver(args.output_path, args.remove_prefix_in_ckpt,
                            base_info={"family": pipe.family, "task": args.task})
    config = LoopConfig(learning_rate=args.learning_rate, weight_decay=args.weight_decay, num_epochs=args.num_epochs,
                        max_steps=args.max_steps, batch_size=args.batch_size,
                        gradient_accumulation_steps=args.gradient_accumulation_steps,
                        max_grad_norm=args.max_grad_norm, lr_scheduler=args.lr_scheduler,
                        lr_warmup_steps=args.lr_warmup_steps, seed=args.seed, num_workers=args.dataset_num_workers,
                        save_steps=args.save_steps, customized_optimizer=args.customized_optimizer,
                        progress=not args.no_progress, output_path=args.output_path,
                        save_state_steps=args.save_state_steps, save_state=args.save_state,
                        keep_states=args.keep_last_states, resume_from=resume_state, force_resume=args.force_resume,
                        extra={"exactness": {"task": args.task.split(":")[0], "trainable": trainable_set(args),
                                             "lora_rank": args.lora_rank,
                                             "lora_target_modules": args.lora_target_modules}})
    if args.validation_prompts:
        from .validation import Validator

        config.validate = Validator(args, pipe, components, cache_dir=args.dataset_base_path if from_cache else None)
        config.validation_steps = args.validation_steps
    summary = train(accelerator, dataset, module, config, saver=saver)
    bad = list(getattr(dataset, "bad_samples", []) or [])
    known = {b.get("id") for b in bad}
    bad += [{"id": dataset.sample_id(i), "reason": "failed to load"} for i in sorted(module.skipped)
            if hasattr(dataset, "sample_id") and dataset.sample_id(i) not in known]
    bad = bad_samples_of_all_processes(accelerator, bad)
    if bad and accelerator.is_main_process:
        report = Path(args.output_path) / "bad_samples.json"
        _write_json(report, {"skipped": bad, "note": "rows left out of training (--on_bad_sample skip)"})
        log(f"skipped {len(bad)} bad sample(s); listed in {report}")
    summary["skipped"] = [b.get("id") for b in bad]
    accelerator.end_training()
    summary["saved"] = [str(p) for p in saver.saved]
    return summary


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


def ensure_writable(path: str, flag: str = "--output_path") -> None:
    """Fail before any work if the output directory cannot be created or written."""
    import tempfile

    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".difftune-write-test-"):
            pass
    except OSError as err:
        raise UserError(f"{flag} {path}: cannot write there ({err.strerror or err})") from None


def load_full_weights(pipe, path: str, remove_prefix: str | None) -> None:
    """`--resume_from_checkpoint`: full-model weights saved by a previous run (the reference's meaning)."""
    from safetensors.torch import load_file

    if not str(path).endswith(".safetensors"):
        raise UserError(f"--resume_from_checkpoint {path}: only .safetensors files are read (no pickles)")
    state = load_file(path)
    prefix = remove_prefix or "pipe.dit."
    model_name = prefix.split(".")[1] if prefix.startswith("pipe.") else "dit"
    model = pipe.models.get(model_name)
    if model is None:
        raise UserError(f"--resume_from_checkpoint {path}: model '{model_name}' is not loaded")
    missing, unexpected = model.load_state_dict(state, strict=False)
    if unexpected:
        raise UserError(f"--resume_from_checkpoint {path}: keys that {model_name} does not have, e.g. {unexpected[0]}")


def _write_json(path: Path, data) -> None:
    atomic_write_text(path, json.dumps(data, indent=2, default=str))
