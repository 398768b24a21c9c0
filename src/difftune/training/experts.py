"""`--train_experts both`: a pair of denoisers that share the timesteps (Wan2.2 A14B's high- and low-noise DiTs)
trained in one command. Stage 1 does not read a denoiser, so it runs once; stage 2 then runs per expert from that
cache, each expert in the denoiser's slot with its share of the timesteps (the reference's two commands:
[0, boundary) for the high-noise one, [boundary, 1) for the low-noise one), into `<output_path>/high_noise/` and
`<output_path>/low_noise/`. Each LoRA is keyed as the denoiser's, as the reference's separate runs give.
"""

from __future__ import annotations

import copy
import os

from ..errors import UserError
from ..util import names

EXPERT_FOLDERS = ("high_noise", "low_noise")


def check_experts(args, family, models, task, log=print) -> tuple[str, str]:
    """The pair's slots (high noise first), or a one-line refusal before any model loads."""
    if not family.experts:
        raise UserError(f"--train_experts both: the {family.name} family has no pair of expert denoisers")
    high, low = family.experts
    given = [slot for slot, _ in models]
    if high not in given or low not in given:
        raise UserError(f"--train_experts both: name both experts' weights in --model_paths (found "
                        f"{', '.join(s for s in (high, low) if s in given) or 'neither'}; the high-noise one first)")
    boundary = getattr(args, "expert_boundary", None)
    if boundary is None and family.expert_boundary is not None:
        boundary = family.expert_boundary(models)
        if boundary is not None:
            log(f"note: --expert_boundary {boundary} (the reference's for this pair; pass the flag to change it)")
            args.expert_boundary = boundary
    if boundary is None or not 0.0 < boundary < 1.0:
        raise UserError(f"--expert_boundary {boundary}: --train_experts both needs the fraction of the training "
                        f"timestep table where the experts meet, in (0, 1) (Wan2.2-I2V-A14B 0.358, T2V-A14B 0.417)")
    if getattr(args, "timestep_sampling", "uniform") != "uniform":  # found now, not after stage 1
        raise UserError("--train_experts both: the experts' timestep ranges work with --timestep_sampling uniform "
                        "only")
    if (args.min_timestep_boundary, args.max_timestep_boundary) != (0.0, 1.0):
        raise UserError("--max_timestep_boundary / --min_timestep_boundary: not with --train_experts both, which "
                        "sets each expert's range from --expert_boundary")
    trained = names([*names(args.trainable_models), args.lora_base_model])
    if trained != [high]:
        raise UserError(f"--train_experts both trains the denoiser of each expert: --lora_base_model or "
                        f"--trainable_models must name {high} alone (got {', '.join(trained) or 'nothing'})")
    if task.stage == "data_process":
        raise UserError("--train_experts both: not with *:data_process (stage 1 does not depend on the expert; "
                        "run it without the flag, then *:train --train_experts both on the cache)")
    return high, low


def expert_runs(args, models, high: str, low: str) -> list[tuple[str, object, list]]:
    """(folder, args, models) per expert: the low-noise weights take the denoiser's slot for its run."""
    b = args.expert_boundary
    runs = []
    for folder, slot, lo, hi in ((EXPERT_FOLDERS[0], high, 0.0, b), (EXPERT_FOLDERS[1], low, b, 1.0)):
        a = copy.copy(args)
        a.output_path = os.path.join(args.output_path, folder)
        a.min_timestep_boundary, a.max_timestep_boundary = lo, hi
        chosen = [(high, config) for s, config in models if s == slot]
        runs.append((folder, a, chosen + [(s, c) for s, c in models if s not in (high, low)]))
    return runs
