"""`difftune train`'s flags: the shared run configuration's fields (training/config.py), every family's own options
(each family declares them), and the reference's flags difftune refuses by name.

Users paste the reference's command lines and change only the script path, so names, defaults and meanings follow
DiffSynth-Studio's documentation. A family's flag given to a run of another family is refused in one line.
"""

from __future__ import annotations

import argparse

from ..core.family import families
from ..core.options import add_flags, flag_fields
from ..errors import UserError
from ..training.config import RunConfig, task_choices

def add_training_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    from ..training.losses import all_losses

    add_flags(parser, RunConfig, "train")
    for action in parser._actions:  # the tasks come from the loss table (shared and the families' own)
        if action.dest == "task":
            action.choices = task_choices(all_losses())
    seen = {f.name for f in flag_fields(RunConfig)}
    add_family_flags(parser, "train", seen)
    g = parser.add_argument_group("reference flags difftune refuses (not implemented yet: a run that names one stops)")
    for name, (kind, why) in REFUSED.items():
        if kind == "switch":
            g.add_argument(f"--{name}", action="store_true", default=None, help=why)
        else:
            g.add_argument(f"--{name}", default=None, help=why)
    return parser


def add_family_flags(parser: argparse.ArgumentParser, command: str, seen: set[str]) -> None:
    """Every family's flags for `command`, grouped by family; a flag several families declare is listed once,
    under all their names (absent flags stay out of the namespace: a run can tell which were given)."""
    specs = sorted((name, spec.options_for(command)) for name, spec in families().items())
    owners: dict[str, list[str]] = {}
    for name, options in specs:
        for f in flag_fields(options):
            if f.metadata["flag"][command]:
                owners.setdefault(f.name, []).append(name)
    for name, options in specs:
        shared = {flag for flag, who in owners.items() if len(who) > 1 and who[0] == name and flag not in seen}
        if shared:
            add_flags(parser, options, command, title=f"{', '.join(owners[next(iter(shared))])} flags",
                      suppress_defaults=True, seen=seen | (set(owners) - shared))
            seen |= shared
    for name, options in specs:
        add_flags(parser, options, command, title=f"{name} flags", suppress_defaults=True, seen=seen)


# The reference's flags we do not implement: refused by name rather than ignored (name -> (kind, why)).
REFUSED = {
    "template_model_id_or_path": ("value", "Diffusion Templates are not implemented"),
    "enable_lora_hot_loading": ("switch", "Diffusion Templates (LoRA hot loading) are not implemented"),
}
# Families of the reference's flags that belong to a training script difftune does not have (prefix -> why): refused
# before parsing, naming the first such flag, rather than as unknown arguments.
REFUSED_PREFIXES = {"dmd2_": "DMD2 distillation (the reference's special/dmd2 train.py: its fake-score model, "
                             "discriminator and student sampling) is not implemented"}


def check_refused_prefixes(argv: list[str]) -> None:
    for arg in argv:
        for prefix, why in REFUSED_PREFIXES.items():
            if arg.startswith(f"--{prefix}"):
                raise UserError(f"{arg.split('=')[0]}: not supported by difftune: {why}")


# Numbers that make a run do nothing or nonsense (flag -> (smallest allowed, what it must be)); None = unset.
_AT_LEAST = {
    "max_steps": (1, "at least 1 optimizer step"), "num_epochs": (1, "at least 1"), "dataset_repeat": (1, "at least 1"),
    "batch_size": (1, "at least 1"), "gradient_accumulation_steps": (1, "at least 1"), "lora_rank": (1, "at least 1"),
    "save_steps": (1, "at least 1 optimizer step (leave it out to save once per epoch)"),
    "save_state_steps": (1, "at least 1 optimizer step"), "validation_steps": (1, "at least 1 optimizer step"),
    "validation_size": (1, "at least 1 pixel"), "validation_inference_steps": (1, "at least 1"),
    "num_frames": (1, "at least 1 frame"), "validation_num_frames": (1, "at least 1 frame"),
    "height": (1, "at least 1 pixel"), "width": (1, "at least 1 pixel"), "max_pixels": (1, "at least 1 pixel"),
    "data_process_batch_size": (1, "at least 1"), "cache_commit_every": (1, "at least 1 sample"),
    "dataset_num_workers": (0, "0 or more"), "lr_warmup_steps": (0, "0 or more"),
    "keep_last_states": (0, "0 (keep every state) or more"), "blocks_to_swap": (0, "0 or more blocks"),
}
_POSITIVE = ("learning_rate", "lora_alpha", "cpu_offload_split_threshold")  # floats that must be > 0 (and finite)
_NOT_NEGATIVE = ("weight_decay", "max_grad_norm")  # floats that must be >= 0 (and finite); max_grad_norm 0 = off


def _check_numbers(args) -> None:
    import math

    for name, (low, what) in _AT_LEAST.items():
        value = getattr(args, name, None)
        if value is not None and value < low:
            raise UserError(f"--{name} {value}: must be {what}")
    for name in (*_POSITIVE, *_NOT_NEGATIVE):
        value = getattr(args, name, None)
        if value is None:
            continue
        if not math.isfinite(value) or value < 0 or (value == 0 and name in _POSITIVE):
            raise UserError(f"--{name} {value}: must be a finite number {'above 0' if name in _POSITIVE else '>= 0'}")
    alpha, rank = getattr(args, "lora_alpha", None), getattr(args, "lora_rank", None)
    if alpha is not None and rank:
        from ..lora.formats import MAX_ALPHA_PER_RANK

        if alpha / rank > MAX_ALPHA_PER_RANK:  # as a file's alpha is refused (1e30 ended as a non-finite loss)
            raise UserError(f"--lora_alpha {alpha:g}: at --lora_rank {rank} a scale of {alpha / rank:g}; at most "
                            f"{MAX_ALPHA_PER_RANK:g} x the rank is a LoRA anyone trains")


def check_training_args(args) -> None:
    """Refuse, in one line, a reference flag that difftune would otherwise accept and ignore, and numbers that
    would make the run do nothing (`--max_steps 0`) or nonsense."""
    for name, (_, why) in REFUSED.items():
        if getattr(args, name, None) is not None:
            raise UserError(f"--{name}: not supported by difftune: {why}")
    _check_numbers(args)
    lo, hi = getattr(args, "min_timestep_boundary", 0.0), getattr(args, "max_timestep_boundary", 1.0)
    if not 0.0 < hi <= 1.0:
        raise UserError(f"--max_timestep_boundary {hi}: must be in (0, 1], a fraction of the training timestep table "
                        f"(the reference's units: 0.358 ~ t=900 at a shift of 5)")
    if not 0.0 <= lo < hi:
        raise UserError(f"--min_timestep_boundary {lo}: must be in [0, --max_timestep_boundary {hi})")
    if getattr(args, "offload_models", None):
        print(f"note: --offload_models {args.offload_models} is not needed: each stage loads only the models it "
              f"uses (the rest are never loaded)")


def training_parser(prog: str = "difftune train") -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description="Train a diffusion model (reference-compatible flags).")
    return add_training_args(parser)


__all__ = ["REFUSED", "REFUSED_PREFIXES", "add_training_args", "check_refused_prefixes", "check_training_args",
           "training_parser"]
