"""`--train_experts both`: a pair of denoisers that share the timesteps (Wan2.2 A14B's high- and low-noise DiTs)
trained in one command. Stage 1 does not read a denoiser, so it runs once; stage 2 then runs per expert from that
cache, each expert in the denoiser's slot with its share of the timesteps (the reference's two commands:
[0, boundary) for the high-noise one, [boundary, 1) for the low-noise one), into `<output_path>/high_noise/` and
`<output_path>/low_noise/`. Each LoRA is keyed as the denoiser's, as the reference's separate runs give.
"""

from __future__ import annotations

import os

from ..errors import UserError

EXPERT_FOLDERS = ("high_noise", "low_noise")


def check_experts(run) -> tuple[str, str, float]:
    """The pair's slots (high noise first) and where they meet, or a one-line refusal before any model loads."""
    config, family, models, task, log = run.config, run.family, run.models, run.task, run.log
    if not family.experts:
        raise UserError(f"--train_experts both: the {family.name} family has no pair of expert denoisers")
    high, low = family.experts
    given = [slot for slot, _ in models]
    if high not in given or low not in given:
        raise UserError(f"--train_experts both: name both experts' weights in --model_paths (found "
                        f"{', '.join(s for s in (high, low) if s in given) or 'neither'}; the high-noise one first)")
    boundary = config.expert_boundary
    if boundary is None and family.expert_boundary is not None:
        boundary = family.expert_boundary(models)
        if boundary is not None:
            log(f"note: --expert_boundary {boundary} (the reference's for this pair; pass the flag to change it)")
    if boundary is None or not 0.0 < boundary < 1.0:
        raise UserError(f"--expert_boundary {boundary}: --train_experts both needs the fraction of the training "
                        f"timestep table where the experts meet, in (0, 1)")
    if config.timestep_sampling != "uniform":  # found now, not after stage 1
        raise UserError("--train_experts both: the experts' timestep ranges work with --timestep_sampling uniform "
                        "only")
    if (config.min_timestep_boundary, config.max_timestep_boundary) != (0.0, 1.0):
        raise UserError("--max_timestep_boundary / --min_timestep_boundary: not with --train_experts both, which "
                        "sets each expert's range from --expert_boundary")
    trained = config.trainable
    if trained != [high]:
        raise UserError(f"--train_experts both trains the denoiser of each expert: --lora_base_model or "
                        f"--trainable_models must name {high} alone (got {', '.join(trained) or 'nothing'})")
    if task.stage == "data_process":
        raise UserError("--train_experts both: not with *:data_process (stage 1 does not depend on the expert; "
                        "run it without the flag, then *:train --train_experts both on the cache)")
    return high, low, boundary


def expert_runs(run, high: str, low: str, boundary: float) -> list[tuple[str, object]]:
    """(folder, run) per expert: the low-noise weights take the denoiser's slot for its run."""
    runs = []
    for folder, slot, lo, hi in ((EXPERT_FOLDERS[0], high, 0.0, boundary), (EXPERT_FOLDERS[1], low, boundary, 1.0)):
        config = run.config.replace(output_path=os.path.join(run.config.output_path, folder),
                                    min_timestep_boundary=lo, max_timestep_boundary=hi, expert_boundary=boundary)
        chosen = [(high, model) for s, model in run.models if s == slot]
        detected = {s: d for s, d in run.detected.items() if s not in (high, low)}
        if slot in run.detected:
            detected[high] = run.detected[slot]
        runs.append((folder, run.replace(config=config, detected=detected,
                                         models=chosen + [(s, m) for s, m in run.models if s not in (high, low)])))
    return runs


def train_experts(run, stop) -> dict:
    """Stage 1 once (unless training from a cache), then stage 2 per expert."""
    from .stages import fit, from_cache, stage1
    from .stage1 import CACHE_SUBDIR

    high, low, boundary = check_experts(run)
    runs = expert_runs(run, high, low, boundary)
    summary = {}
    if run.task.stage != "train":  # one stage (sft) and split alike: the pair trains from one cache
        cache = os.path.join(run.config.output_path, CACHE_SUBDIR)
        summary["stage1"] = stage1(runs[0][1], cache)
        runs = [(folder, from_cache(r, cache)) for folder, r in runs]
    for folder, r in runs:
        os.makedirs(r.config.output_path, exist_ok=True)
        summary[folder] = fit(r, from_cache=True, stop=stop)
        if summary[folder].get("stopped"):
            break
    return summary
