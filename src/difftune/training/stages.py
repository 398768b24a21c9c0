"""The stages a `train` command runs, each a plain function of the set-up run (`setup.Run`): stage 1 into the cache,
the switch of a run to its cache, and fit (one stage of training with its checkpoints, states, validation and logs);
the checks of the output layouts made before any model is loaded. `recipe.run` puts them in order."""

from __future__ import annotations

import os

import torch

from ..core.attention import backend_context, resolve_backend
from ..errors import UserError
from .setup import Run, stage_settings


def stage1(run: Run, cache: str | None = None) -> dict:
    """Stage 1 into the cache: `<output_path>` for data_process, else `<output_path>/cache`."""
    from .stage1 import CACHE_SUBDIR, run_stage1

    if cache is None:
        cache = run.config.output_path if run.task.stage == "data_process" else \
            os.path.join(run.config.output_path, CACHE_SUBDIR)
    return run_stage1(run, cache)  # which frees its models (gc) before it returns


def from_cache(run: Run, cache: str) -> Run:
    """The run's stage 2 reads what its stage 1 wrote."""
    return run.replace(config=run.config.replace(dataset_base_path=cache, dataset_metadata_path=None))


def check_outputs(run: Run) -> None:
    """Before any model is loaded: the checkpoint layouts the flags ask for exist for this family."""
    config, family = run.config, run.family
    if run.task.stage == "data_process":
        return
    from ..lora import lora_layout_problem

    denoiser = (run.pipeline.loss_models or (None,))[0]
    layout = lora_format(config, family, denoiser, run.pipeline)
    problem = lora_layout_problem(layout, [config.lora_base_model] if config.lora_base_model else [],
                                  denoiser, dict(family.lora_prefixes), reference=family.lora_reference_names is not None)
    if problem:
        raise UserError(f"--lora_format {layout}: {problem}")
    full_converters(config, family)


def lora_format(config, family, denoiser: str | None, pipeline=None) -> str:
    """The layout LoRA checkpoints are written in: --lora_format, or a family flag that asks for one (FLUX's
    --align_to_opensource_format: kohya); left at "default", the family's `lora_default_format` for the denoiser's
    LoRA (the layout diffusers, ComfyUI and the reference's loader all read) and the diffusers layout for another
    model's."""
    requested = config.lora_format
    asks = getattr(config.family_options, "lora_format", None)
    asked = asks() if callable(asks) else None
    if asked is not None:
        layout, flag = asked
        if requested not in ("default", layout):
            raise UserError(f"--lora_format {requested}: {flag} asks for the {layout} layout; give one of the two")
        return layout
    if requested != "default":
        return requested
    if config.lora_base_model and config.lora_base_model != denoiser:
        return "diffusers"
    return getattr(pipeline, "lora_default_format", None) or family.lora_default_format


def full_converters(config, family) -> dict:
    """`--full_format original`: each fully trained model's key renamer, refused before any model loads where the
    family has none for it."""
    if config.full_format != "original":
        return {}
    trained = config.fully_trained
    if not trained:
        raise UserError("--full_format original: no model is fully trained (set --trainable_models)")
    missing = [m for m in trained if m not in family.full_native_keys]
    if missing:
        raise UserError(f"--full_format original: {family.name} has no original key names for "
                        f"{', '.join(missing)} (use --full_format diffusers)")
    return {m: family.full_native_keys[m] for m in trained}


def fit(run: Run, from_cache: bool, stop=None) -> dict:
    """Train one stage: the data (or the cache), the pipeline with the models this stage uses, the training module,
    resume, LoRA or full, the hooks (checkpoints, states, validation, logs), the loop; then the report."""
    from ..models import check_fp8_frozen, check_quant_frozen
    from .builders import find_resume, loop_config, make_dataset, stage_pipeline, training_mode_kwargs
    from .fit import check_resume, train
    from .module import PipelineTrainingModule

    from .offload import install_model_offload, model_offload_requested, offload_settings

    run = run.replace(config=offload_settings(run.config, run.log))
    config, family, split, accelerator, log = run.config, run.family, run.split, run.accelerator, run.log
    if from_cache:
        from .stage1 import open_cache

        dataset, wanted = open_cache(run, log=log), set(split.stage2_models)
        log(f"training from the cache at {config.dataset_base_path} ({len(dataset)} samples): {split.describe()}")
    else:
        dataset, wanted = make_dataset(run), None
    check_fp8_frozen([slot for slot, c in run.models if c.wants_fp8(slot)], config.fully_trained)
    check_quant_frozen({slot: c.quant.method for slot, c in run.models if c.quant is not None}, config.fully_trained)
    for slot, c in run.models:  # a fully trained model from a pre-quantised file trains its decoded weights
        c.decode_prequantized = c.decode_prequantized or slot in config.fully_trained
    pipe = stage_pipeline(run, wanted)
    units = list(split.stage2) if from_cache else pipe.units
    module = PipelineTrainingModule(pipe, run.task.loss, units, seed=config.seed,
                                    settings=stage_settings(config, family), from_cache=from_cache)
    module.attention_backend = resolve_backend(config.attention_backend, pipe.device, config.batch_size)
    resume_state = find_resume(config, pipe)
    # LoRA initialisation draws from the global RNG: seed it here so the initial weights depend only on
    # --seed (and not on which models this stage happened to load before).
    torch.manual_seed(config.seed)
    module.switch_pipe_to_training_mode(pipe, **training_mode_kwargs(config))
    if module.loss.prepare is not None:  # e.g. a frozen teacher, copied once the trainable weights are set up
        module.loss.prepare(module)
    check_lora_names(config, family, module, pipe, log)
    if config.compile and model_offload_requested(config):
        raise UserError("--compile with model offload (--enable_model_cpu_offload / --blocks_to_swap) is not "
                        "supported: the offload hooks swap each block's weights inside its call; drop one of them")
    install_model_offload(module, config, accelerator, log)
    if config.compile:
        from .compile import compile_blocks

        compile_blocks(pipe, [s for s in pipe.loss_models if s in config.trainable], log)
    check_resume(accelerator, dataset, module, loop_config(config, resume_state),  # before the hooks write
                 plain_optimizer=not config.customized_optimizer)
    hooks, saver = make_hooks(run, dataset, from_cache, resume_state)
    with (stop.deferred() if stop is not None else _nothing()), backend_context(module.attention_backend):
        summary = train(accelerator, dataset, module, loop_config(config, resume_state), hooks, stop=stop)
    report_bad_samples(config, accelerator, dataset, module, summary)
    for tracker in accelerator.trackers:  # not accelerator.end_training(): it destroys the process group at once,
        tracker.finish()                  # with no barrier; recipe.run ends a distributed run (finish_distributed)
    summary["saved"] = [str(p) for p in saver.saved]
    if summary.get("stopped"):
        summary["stop_message"] = _stop_message(summary, hooks)
    return summary


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def check_lora_names(config, family, module, pipe, log=print) -> None:
    """A LoRA module with no name in the checkpoints' layout is found now, not when the first checkpoint is saved;
    what a reader of that layout skips (the family's `lora_export_notes`) is said once."""
    if config.lora_base_model not in module.lora_configs:
        return
    from ..lora import lora_state_dict

    denoiser = (pipe.loss_models or (None,))[0]
    layout = lora_format(config, family, denoiser, pipe)
    initial = lora_state_dict(pipe.models[config.lora_base_model])
    paths = sorted({k.rpartition(".lora_")[0] for k in initial})
    if layout != "diffusers" and family.lora_native_names:
        family.lora_native_names(initial, {p: 1.0 for p in paths})
    if family.lora_export_notes is not None and config.lora_base_model == denoiser:
        for note in family.lora_export_notes(layout, paths):
            log(f"note: {note}")


def make_hooks(run: Run, dataset, from_cache: bool, resume_state):
    """Checkpoints, training states, validation, the CSV log and the run record: `RunHooks` (and its saver)."""
    from pathlib import Path

    from .checkpoint import CheckpointSaver, CsvLog, RunHooks
    from .run_lock import RunRecord

    config, family, accelerator = run.config, run.family, run.accelerator
    record = None
    if accelerator.is_main_process:  # the folder's training_args.json follows once this run writes there
        record = RunRecord(config.output_path, config.record())
        record.start()
    if accelerator.log_with:
        accelerator.init_trackers(record.run_id if record is not None else "train")  # logs/<run id>/
    from .trackers import start as start_trackers

    start_trackers(accelerator, config, record.run_id if record is not None else "train")  # W&B, SwanLab
    validate = None
    if config.validation_prompts:
        from .validation import Validator

        validate = Validator(run, cache_dir=config.dataset_base_path if from_cache else None, dataset=dataset)
    denoiser = (run.pipeline.loss_models or (None,))[0]
    saver = CheckpointSaver(config.output_path, config.checkpoint_prefix(denoiser),
                            lora_prefixes=dict(family.lora_prefixes),
                            base_info={"family": family.name, "task": config.task,
                                       **({"kohya_model_version": family.kohya_model_version}
                                          if family.kohya_model_version else {})},
                            lora_format=lora_format(config, family, (run.pipeline.loss_models or (None,))[0], run.pipeline),
                            denoiser=(run.pipeline.loss_models or (None,))[0],
                            native_names=family.lora_native_names, reference_names=family.lora_reference_names,
                            full_converters=full_converters(config, family))
    csv = None
    if config.enable_csv_log and accelerator.is_main_process:
        csv = CsvLog(Path(config.output_path) / "loss.csv", resume_step=_resume_step(resume_state))
    hooks = RunHooks(saver, save_steps=config.save_steps, state_dir=config.output_path,
                     save_state_steps=config.save_state_steps, save_state=config.save_state,
                     keep_states=config.keep_last_states, validate=validate, validation_steps=config.validation_steps,
                     csv=csv, record=record)
    return hooks, saver


def _stop_message(summary: dict, hooks) -> str:
    import signal

    name = signal.Signals(summary["stopped"]).name
    saved = hooks.last_checkpoint()
    what = f"saved {saved}" if saved is not None else "nothing saved"
    if hooks.last_state is not None and hooks.state_step == summary["steps"]:
        return (f"stopped by {name} at step {summary['steps']}: {what} and the training state {hooks.last_state}; "
                f"continue with --resume_from_checkpoint latest")
    return (f"stopped by {name} at step {summary['steps']}: {what} (no training state: --save_state_steps N "
            f"makes a run resumable)")


def _resume_step(state_dir) -> int:
    if state_dir is None:
        return 0
    import json
    from pathlib import Path

    return int(json.loads((Path(state_dir) / "state.json").read_text())["position"]["global_step"])


def report_bad_samples(config, accelerator, dataset, module, summary: dict) -> None:
    """Rows left out (--on_bad_sample skip), from every process, in <output_path>/bad_samples.json."""
    from pathlib import Path

    from .builders import bad_samples_of_all_processes, write_json

    bad = list(getattr(dataset, "bad_samples", []) or [])
    known = {b.get("id") for b in bad}
    bad += [{"id": dataset.sample_id(i), "reason": "failed to load"} for i in sorted(module.skipped)
            if hasattr(dataset, "sample_id") and dataset.sample_id(i) not in known]
    bad = bad_samples_of_all_processes(accelerator, bad)
    if bad and accelerator.is_main_process:
        report = Path(config.output_path) / "bad_samples.json"
        write_json(report, {"skipped": bad, "note": "rows left out of training (--on_bad_sample skip)"})
        print(f"skipped {len(bad)} bad sample(s); listed in {report}")
    summary["skipped"] = [b.get("id") for b in bad]
