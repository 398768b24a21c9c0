"""Options declared once as dataclass fields, turned into command-line flags by the CLI.

The shared run configuration (`training/config.py`) and each family's own options (`FamilySpec.options`: its
tokenizer paths and switches) are dataclasses whose fields carry
their flag's help and parsing here; the CLI builds argparse flags from them, so a flag is written in one place and
a family adds flags without an edit outside its package.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable, Sequence
from typing import Any

SWITCH = "switch"  # a flag without a value (store_true)
BOOL = "bool"  # true/false, also as a bare switch (--flag means true)


def parse_bool(value: str) -> bool:
    if value.lower() in ("1", "true", "yes", "on"):
        return True
    if value.lower() in ("0", "false", "no", "off"):
        return False
    raise argparse.ArgumentTypeError(f"expected true/false, got {value!r}")


def option(default: Any = None, help: str = "", *, kind: Any = str, choices: Sequence | None = None,
           group: str = "", required: bool = False, sample: bool = False, train: bool = True,
           repeat: bool = False, load: str | None = None) -> Any:
    """A dataclass field that is also a flag. `kind`: str, int, float, SWITCH, BOOL or a parser function.
    `sample` / `train`: whether `difftune sample` / `difftune train` take it. `repeat`: a flag given several times
    (a list). `load`: the value names image file(s) that `difftune sample` reads in this mode ("RGB", "RGBA") and
    passes to the pipeline as images."""
    meta = {"help": help, "kind": kind, "choices": tuple(choices) if choices else None, "group": group,
            "required": required, "sample": sample, "train": train, "repeat": repeat, "load": load}
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"flag": meta})
    return dataclasses.field(default=default, metadata={"flag": meta})


def sample_input(help: str, *, kind: Any = str, choices: Sequence | None = None, repeat: bool = False,
                 load: str | None = None, input: str | None = None) -> dict[str, Any]:
    """A `difftune sample` flag that is a sampling input, declared by the feature or pipeline that takes it
    (`Feature.flags`, `BasePipeline.sample_flags`): `input` is the input's name (default: the flag's); see `option`
    for the rest."""
    return {"help": help, "kind": kind, "choices": choices, "repeat": repeat, "load": load, "input": input}


def with_sample_inputs(cls, inputs: dict[str, dict[str, Any]], group: str) -> type:
    """`cls` (a family's options) with the sampling inputs' flags added (`difftune sample` parses them all at
    once); a name `cls` declares already stays its own."""
    names = {f.name for f in dataclasses.fields(cls)}
    extra = [(name, Any, option(None, **{k: v for k, v in spec.items() if k != "input"}, group=group, sample=True,
                                train=False)) for name, spec in inputs.items() if name not in names]
    return dataclasses.make_dataclass(cls.__name__, extra, bases=(cls,), frozen=True) if extra else cls


def flag_fields(cls) -> list[dataclasses.Field]:
    return [f for f in dataclasses.fields(cls) if "flag" in f.metadata]


def add_flags(parser: argparse.ArgumentParser, cls, command: str = "train", title: str | None = None,
              suppress_defaults: bool = False, seen: set[str] | None = None) -> list[str]:
    """Add `cls`'s flags for `command` to `parser` (grouped by each field's group, or under `title`); returns their
    names. `suppress_defaults`: absent flags stay out of the namespace (so a run can tell which were given).
    `seen`: names already added by another declaration (a flag two families share is added once)."""
    added, groups = [], {}
    for f in flag_fields(cls):
        meta = f.metadata["flag"]
        if not meta[command] or (seen is not None and f.name in seen):
            continue
        name = title or meta["group"] or "options"
        group = groups.get(name) or groups.setdefault(name, parser.add_argument_group(name))
        kwargs: dict[str, Any] = {"help": meta["help"]}
        default = f.default if f.default is not dataclasses.MISSING else \
            f.default_factory() if f.default_factory is not dataclasses.MISSING else None
        kwargs["default"] = argparse.SUPPRESS if suppress_defaults else default
        kind = meta["kind"]
        if kind == SWITCH:
            kwargs["action"] = "store_true"
        elif kind == BOOL:
            kwargs.update(type=parse_bool, nargs="?", const=True)
        else:
            kwargs["type"] = kind
            if meta["repeat"]:
                kwargs["action"] = "append"
                if not suppress_defaults:
                    kwargs["default"] = None
        if meta["choices"]:
            kwargs["choices"] = meta["choices"]
        if meta["required"]:
            kwargs["required"] = True
            kwargs.pop("default")
        group.add_argument(f"--{f.name}", **kwargs)
        added.append(f.name)
        if seen is not None:
            seen.add(f.name)
    return added


def from_values(cls, values: dict[str, Any], command: str | None = None) -> Any:
    """An instance of `cls` from parsed flag values (absent ones keep their defaults)."""
    names = {f.name for f in dataclasses.fields(cls)}
    kwargs = {k: v for k, v in values.items() if k in names}
    if command is not None:  # a repeated flag given nowhere is its default, not None
        for f in flag_fields(cls):
            if kwargs.get(f.name, 0) is None and f.metadata["flag"]["repeat"]:
                kwargs.pop(f.name)
    return cls(**kwargs)


class NoOptions:
    """A family without options of its own."""


NoOptions = dataclasses.dataclass(frozen=True)(NoOptions)


def option_names(cls, command: str = "train") -> tuple[str, ...]:
    return tuple(f.name for f in flag_fields(cls) if f.metadata["flag"][command])


def described(cls, command: str, choose: Callable[[str], bool] = lambda n: True) -> dict[str, str]:
    return {f.name: f.metadata["flag"]["help"] for f in flag_fields(cls) if f.metadata["flag"][command]
            and choose(f.name)}


__all__ = ["BOOL", "NoOptions", "SWITCH", "add_flags", "described", "flag_fields", "from_values", "option",
           "option_names", "parse_bool", "sample_input", "with_sample_inputs"]
