"""Features: the parts of a family's pipeline that only some runs use (edit images, a ControlNet, image-to-video, ...).

A unit names the feature it serves (`PipelineUnit.feature`, "base" when every run needs it), and a pipeline
declares its features (`BasePipeline.features`): what switches each one on, the values its part of `model_fn`
reads and the data columns it reads. A run resolves its active features once, before the split, from what it
knows up front: the data columns it loads, the family's flags and the models it was given (their configs, read
from the headers; nothing is loaded for it). The split, the cache, its fingerprint and the log then see the base
units plus the active ones only, so a plain text-to-image run neither runs nor caches an edit unit, and adding a
feature to a family leaves every existing cache of it valid.

Inference resolves the same way from the call's inputs and the loaded models. Diffusers' modular pipelines select
their blocks from trigger inputs alike.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

BASE = "base"


@dataclass(frozen=True)
class RunContext:
    """What a run knows before any model is loaded.

    `columns`: the data columns it loads (training: --extra_inputs and the --data_file_keys the metadata has;
    inference: the inputs given, not None). `models`: slot -> that model's config (a dict: the config.json or the
    official config its weights matched). `options`: the family's options (its flags), or None."""

    columns: frozenset[str] = frozenset()
    models: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)
    options: Any = None

    def config(self, slot: str) -> Mapping[str, Any] | None:
        """The config of the model in `slot`, or None when no model fills it."""
        return self.models.get(slot)

    def has(self, *columns: str) -> bool:
        return any(c in self.columns for c in columns)

    def option(self, name: str, default=None):
        return getattr(self.options, name, default) if self.options is not None else default


@dataclass(frozen=True)
class Feature:
    """One feature of a pipeline. It is active when any of its `columns` is a data column / call input, or any of
    its `models` is given, or `when(context)` is true (when given, `when` alone decides)."""

    name: str
    columns: tuple[str, ...] = ()
    models: tuple[str, ...] = ()
    when: Callable[[RunContext], bool] | None = None
    # Values its part of `model_fn` reads (besides the pipeline's base `model_fn_inputs`).
    model_fn_inputs: tuple[str, ...] = ()
    # Data columns it reads (default: its trigger columns); a flag naming a column no feature reads is refused.
    data_inputs: tuple[str, ...] | None = None
    # Other features it needs (switched on with it).
    requires: tuple[str, ...] = ()
    # Pairs of list-valued data columns that give one entry per item each (EliGen: a prompt per mask): the data
    # set's row check compares their lengths before the first step, naming the row.
    same_length: tuple[tuple[str, str], ...] = ()
    description: str = ""

    def reads(self) -> tuple[str, ...]:
        return self.columns if self.data_inputs is None else self.data_inputs

    def active(self, context: RunContext) -> bool:
        if self.when is not None:
            return bool(self.when(context))
        return context.has(*self.columns) or any(context.config(m) is not None for m in self.models)


def resolve_features(features: Sequence[Feature], context: RunContext) -> frozenset[str]:
    """The active features' names (base always), with what they require."""
    by_name = {f.name: f for f in features}
    active = {f.name for f in features if f.active(context)}
    todo = list(active)
    while todo:
        for need in by_name[todo.pop()].requires:
            if need not in active:
                active.add(need)
                todo.append(need)
    return frozenset(active | {BASE})


def model_config(module) -> dict:
    """A loaded model's config as a plain dict (diffusers' FrozenDict, a transformers config, or nothing)."""
    config = getattr(module, "config", None)
    if config is None:
        return {}
    if hasattr(config, "to_dict"):
        return config.to_dict()
    return dict(config)


def describe(features: Iterable[str]) -> str:
    rest = sorted(set(features) - {BASE})
    return ", ".join([BASE, *rest])


__all__ = ["BASE", "Feature", "RunContext", "describe", "model_config", "resolve_features"]
