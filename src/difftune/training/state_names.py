"""A saved training state's parameter names against the run's (shared by the state formats of state.py and
deepspeed_state.py)."""

from __future__ import annotations

from pathlib import Path

from ..errors import UserError


def check_names(path: Path, saved: list[str], names: list[str]) -> None:
    missing = [n for n in saved if n not in set(names)]
    extra = [n for n in names if n not in set(saved)]
    if missing or extra:
        which = f"has parameters this run does not train, e.g. {missing[0]}" if missing else \
            f"lacks parameters this run trains, e.g. {extra[0]}"
        raise UserError(f"{path}: the saved state {which}")
