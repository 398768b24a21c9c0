"""The `train` command as a recipe: build the family, the accelerator and the split; [stage 1 into the cache];
the pipeline with only the models the stage uses; the training module; LoRA or full; resume; train with
hooks (checkpoints, states, validation, logs); save.

Tasks: `sft` / `direct_distill` train in one stage; `<task>:data_process` runs stage 1 and writes the cache;
`<task>:train` trains from a cache; `<task>:split` does both in one command, freeing the stage-1 models
before stage 2.
"""

from __future__ import annotations

import copy
import gc
import os
from pathlib import Path

import torch

from .builders import (TaskSpec, bad_samples_of_all_processes, build_pipeline, compute_split, ensure_writable,
                       find_resume, frame_settings, loop_config, main_process_log, make_accelerator, make_dataset,
                       resolve_models, stage_settings, training_mode_kwargs, write_json)


def run(args) -> dict:
    """Run the command; with SIGTERM / SIGINT during training it saves, and the summary says `stopped`."""
    from .run_lock import output_lock
    from .signals import StopSignals

    task = TaskSpec.parse(args.task)
    ensure_writable(args.output_path)
    accelerator = make_accelerator(args, None if task.stage == "data_process" else args.output_path)
    log = main_process_log(accelerator)
    with StopSignals(verbose=accelerator.is_main_process) as stop, \
            output_lock(args.output_path, enabled=accelerator.is_main_process,
                        cache_only=task.stage == "data_process", log=log):
        return _run(args, task, accelerator, log, stop)


def _run(args, task, accelerator, log, stop) -> dict:
    family, models = resolve_models(args, log=log)
    frame_settings(args, family)  # --num_frames refused or checked before any work
    if task.stage != "data_process":
        check_lora_format(args, family)
        full_converters(args, family)
    if getattr(args, "train_experts", None):
        return _run_experts(args, task, family, models, accelerator, stop)
    if getattr(args, "expert_boundary", None) is not None:
        from ..errors import UserError

        raise UserError("--expert_boundary: only with --train_experts both (one expert per run takes "
                        "--max_timestep_boundary / --min_timestep_boundary)")
    split = compute_split(family, args, task)
    stage1 = None
    if task.stage in ("data_process", "split"):
        from .stage1 import CACHE_SUBDIR, run_stage1

        cache = args.output_path if task.stage == "data_process" else os.path.join(args.output_path, CACHE_SUBDIR)
        stage1 = run_stage1(args, family, models, split, accelerator, cache)
        if task.stage == "data_process":
            return stage1
        gc.collect()
        args = copy.copy(args)  # stage 2 of the same command reads what stage 1 wrote
        args.dataset_base_path, args.dataset_metadata_path = cache, None
    summary = train_stage(args, task, family, models, split, accelerator, from_cache=task.stage in ("train", "split"),
                          stop=stop)
    if stage1 is not None:
        summary["stage1"] = stage1
    return summary


def _run_experts(args, task, family, models, accelerator, stop) -> dict:
    """`--train_experts both`: stage 1 once (unless training from a cache), then stage 2 per expert."""
    from .experts import check_experts, expert_runs

    args = copy.copy(args)  # the boundary may be filled in
    high, low = check_experts(args, family, models, task, log=main_process_log(accelerator))
    runs = expert_runs(args, models, high, low)
    split = compute_split(family, runs[0][1], task)
    summary = {}
    if task.stage != "train":  # one stage (sft) and split alike: the pair trains from one cache
        from .stage1 import CACHE_SUBDIR, run_stage1

        cache = os.path.join(args.output_path, CACHE_SUBDIR)
        summary["stage1"] = run_stage1(args, family, runs[0][2], split, accelerator, cache)
        gc.collect()
        for _, a, _ in runs:
            a.dataset_base_path, a.dataset_metadata_path = cache, None
    for folder, a, chosen in runs:
        os.makedirs(a.output_path, exist_ok=True)
        summary[folder] = train_stage(a, task, family, chosen, split, accelerator, from_cache=True, stop=stop)
        if summary[folder].get("stopped"):
            break
    return summary


def check_lora_format(args, family) -> None:
    """Before any model is loaded: `--lora_format comfyui|kohya` names only the denoiser's LoRA."""
    from ..errors import UserError
    from ..lora import lora_layout_problem

    denoiser = (family.pipeline.loss_models or (None,))[0]
    problem = lora_layout_problem(args.lora_format, [args.lora_base_model] if args.lora_base_model else [], denoiser,
                                  dict(family.lora_prefixes))
    if problem:
        raise UserError(f"--lora_format {args.lora_format}: {problem}")


def full_converters(args, family) -> dict:
    """`--full_format original`: each fully trained model's key renamer, refused before any model loads where the
    family has none for it."""
    from ..errors import UserError
    from ..util import names

    if getattr(args, "full_format", "diffusers") != "original":
        return {}
    trained = names(args.trainable_models)
    if not trained:
        raise UserError("--full_format original: no model is fully trained (set --trainable_models)")
    missing = [m for m in trained if m not in family.full_native_keys]
    if missing:
        raise UserError(f"--full_format original: {family.name} has no original key names for "
                        f"{', '.join(missing)} (use --full_format diffusers)")
    return {m: family.full_native_keys[m] for m in trained}


def train_stage(args, task, family, models, split, accelerator, from_cache: bool, stop=None) -> dict:
    from .checkpoint import CheckpointSaver, CsvLog, RunHooks
    from .loop import train
    from .module import PipelineTrainingModule
    from .run_lock import RunRecord

    log = main_process_log(accelerator)
    if from_cache:
        from .stage1 import open_cache

        dataset, wanted = open_cache(args, family, split, log=log), set(split.stage2_models)
        log(f"training from the cache at {args.dataset_base_path} ({len(dataset)} samples): {split.describe()}")
    else:
        dataset, wanted = make_dataset(args, family), None
    from ..models import check_fp8_frozen, check_quant_frozen

    check_fp8_frozen([slot for slot, c in models if c.wants_fp8(slot)], args.trainable_models)
    check_quant_frozen([slot for slot, c in models if c.quant is not None], args.trainable_models)
    pipe = build_pipeline(family, args, models, wanted, accelerator.device, log=log)
    stage_units = {type(u) for u in split.stage2}
    units = [u for u in pipe.units if type(u) in stage_units] if from_cache else pipe.units
    module = PipelineTrainingModule(pipe, task.loss, units, seed=args.seed, settings=stage_settings(args, family),
                                    from_cache=from_cache)
    resume_state = find_resume(args, pipe)
    # LoRA initialisation draws from the global RNG: seed it here so the initial weights depend only on
    # --seed (and not on which models this stage happened to load before).
    torch.manual_seed(args.seed)
    module.switch_pipe_to_training_mode(pipe, **training_mode_kwargs(args))
    if args.lora_format != "diffusers" and family.lora_native_names and args.lora_base_model in module.lora_configs:
        # a LoRA module with no name in that layout is found now, not when the first checkpoint is saved
        from ..lora import lora_state_dict

        initial = lora_state_dict(pipe.models[args.lora_base_model])
        family.lora_native_names(initial, {k.rpartition(".lora_")[0]: 1.0 for k in initial})
    record = None
    if accelerator.is_main_process:  # the folder's training_args.json follows once this run writes there
        record = RunRecord(args.output_path, vars(args))
        record.start()
    if accelerator.log_with:
        accelerator.init_trackers(record.run_id if record is not None else "train")  # logs/<run id>/
    validate = None
    if args.validation_prompts:
        from .validation import Validator

        validate = Validator(args, models, family, cache_dir=args.dataset_base_path if from_cache else None)
    saver = CheckpointSaver(args.output_path, args.remove_prefix_in_ckpt, lora_prefixes=dict(family.lora_prefixes),
                            base_info={"family": family.name, "task": args.task}, lora_format=args.lora_format,
                            denoiser=(family.pipeline.loss_models or (None,))[0],
                            native_names=family.lora_native_names,
                            full_converters=full_converters(args, family))
    csv = None
    if args.enable_csv_log and accelerator.is_main_process:
        csv = CsvLog(Path(args.output_path) / "loss.csv", resume_step=_resume_step(resume_state))
    hooks = RunHooks(saver, save_steps=args.save_steps, state_dir=args.output_path,
                     save_state_steps=args.save_state_steps, save_state=args.save_state,
                     keep_states=args.keep_last_states, validate=validate, validation_steps=args.validation_steps,
                     csv=csv, record=record)
    if stop is None:
        summary = train(accelerator, dataset, module, loop_config(args, resume_state), hooks)
    else:
        with stop.deferred():
            summary = train(accelerator, dataset, module, loop_config(args, resume_state), hooks, stop=stop)
    report_bad_samples(args, accelerator, dataset, module, summary)
    accelerator.end_training()
    summary["saved"] = [str(p) for p in saver.saved]
    if summary.get("stopped"):
        summary["stop_message"] = _stop_message(summary, hooks)
    return summary


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

    return int(json.loads((Path(state_dir) / "state.json").read_text())["position"]["global_step"])


def report_bad_samples(args, accelerator, dataset, module, summary: dict) -> None:
    """Rows left out (--on_bad_sample skip), from every process, in <output_path>/bad_samples.json."""
    bad = list(getattr(dataset, "bad_samples", []) or [])
    known = {b.get("id") for b in bad}
    bad += [{"id": dataset.sample_id(i), "reason": "failed to load"} for i in sorted(module.skipped)
            if hasattr(dataset, "sample_id") and dataset.sample_id(i) not in known]
    bad = bad_samples_of_all_processes(accelerator, bad)
    if bad and accelerator.is_main_process:
        report = Path(args.output_path) / "bad_samples.json"
        write_json(report, {"skipped": bad, "note": "rows left out of training (--on_bad_sample skip)"})
        print(f"skipped {len(bad)} bad sample(s); listed in {report}")
    summary["skipped"] = [b.get("id") for b in bad]
