"""Features: the parts of a family's pipeline that only some runs use (edit images, a ControlNet, image-to-video, ...).

A feature is one object that owns what it does: when it is on (its trigger columns, models or predicate), its
units, the model slots it adds, the data columns it reads and their kinds, its data operators, its checks, its part
of the denoiser call, its sampling inputs with their defaults and negatives, and its finishing step. A family's base
pipeline lists its features and nothing of theirs (`BasePipeline` composes slots, units, inputs and checks from
them), so adding a feature is one module and one line in that list.

A run resolves its active features once, before the split, from what it knows up front: the data columns it loads,
the family's flags and the models it was given (their configs, read from the headers; nothing is loaded for it).
The split, the cache, its fingerprint and the log then see the base units plus the active ones only, so a plain
text-to-image run neither runs nor caches an edit unit, and adding a feature to a family leaves every existing cache
of it valid. Inference resolves the same way from the call's inputs and the loaded models. Diffusers' modular
pipelines select their blocks from trigger inputs alike.
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


# The kinds of data column a feature reads (`Feature.inputs`), as the data set hands them to `training_inputs`:
FRAMES = "frames"  # a list of frames (a still image is a one-frame clip)
ALIGNED_FRAMES = "aligned_frames"  # a clip that must have the training clip's frames (one per frame)
ALIGNED_AUDIO = "aligned_audio"  # audio timed with the clip (at the feature's `fps`), which must last as long; raw
IMAGE = "image"  # one image (the first frame of what the column loads)
IMAGES = "images"  # one or several images (a list of what the column loads; one image is a list of one)
VALUE = "value"  # text, numbers or lists, as they come (an empty CSV cell is left out)
RAW = "raw"  # handed on as the data set loaded it (audio paths, lists of files, ...)
KINDS = (FRAMES, ALIGNED_FRAMES, ALIGNED_AUDIO, IMAGE, IMAGES, VALUE, RAW)


@dataclass(frozen=True, eq=False)
class Feature:
    """One feature of a pipeline. It is active when any of its `columns` is a data column / call input, or any of
    its `models` is given, or `when(context)` is true (when given, `when` alone decides).

    What it does is declared here and, where it is code, written in a subclass's methods (`check`, `denoise`,
    `finish`, `operators`): a family's feature module defines the subclass and one instance."""

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
    # -- what it owns ---------------------------------------------------------------------------------------
    # Its units, in order (`compose_units` places them among the base pipeline's).
    units: tuple[Any, ...] = ()
    # Model slots only this feature uses: the pipeline gets them from its features.
    slots: tuple[str, ...] = ()
    # Slots its part of the denoiser call uses (stage 2 loads them with the denoiser).
    loss_models: tuple[str, ...] = ()
    # slot -> what to load, for a run that switches the feature on without that model (one line, before any work).
    needs: Mapping[str, str] = field(default_factory=dict)
    # The models it brings (ComponentSpecs: recognition from the weights) and, for --full_format original, slot ->
    # their keys in the released names: the family registers them with the feature (`FamilySpec`).
    components: tuple[Any, ...] = ()
    native_keys: Mapping[str, Callable[[dict], dict]] = field(default_factory=dict)
    # column -> its kind (FRAMES, ALIGNED_FRAMES, ALIGNED_AUDIO, IMAGE, IMAGES, VALUE, RAW): how `training_inputs`
    # hands it on; the data set's row check holds the aligned ones to the clip's length.
    inputs: Mapping[str, str] = field(default_factory=dict)
    # The clip's frame rate its ALIGNED_AUDIO inputs are timed at (frames after the first, per second of audio).
    fps: float | None = None
    # Sampling inputs (`pipe(..., name=value)`) -> their defaults (None: not given); the reference's names.
    call_inputs: Mapping[str, Any] = field(default_factory=dict)
    # Run-time settings of the denoiser call -> their defaults (`pipe(..., vace_scale=0.8)`), never cached.
    call_settings: Mapping[str, Any] = field(default_factory=dict)
    # Its `difftune sample` flags: name -> `core.options.sample_input(...)`; `sample_values` maps them to inputs.
    flags: Mapping[str, Mapping[str, Any]] = field(default_factory=dict)

    # Run-time settings its units read (from the family's flags in training: never cached), and attributes of the
    # pipeline its units read besides models (a processor, a face embedder) with their defaults: class attributes
    # of a feature's subclass, which the pipeline takes up.
    unit_settings = ()
    attributes = {}

    def reads(self) -> tuple[str, ...]:
        return self.columns if self.data_inputs is None else self.data_inputs

    def active(self, context: RunContext) -> bool:
        if self.when is not None:
            return bool(self.when(context))
        return context.has(*self.columns) or any(context.config(m) is not None for m in self.models)

    def in_call(self, values: Mapping[str, Any]) -> bool:
        """Whether a denoiser call has this feature's part: any of its `model_fn_inputs` is given."""
        return any(values.get(n) is not None for n in self.model_fn_inputs)

    # -- behaviour (a feature's subclass overrides what it needs) ---------------------------------------------
    def check(self, context: RunContext, features: frozenset[str]) -> None:
        """Refuse, in one line and before any work, a run whose models and data do not go together."""

    def operators(self, config) -> dict:
        """Data operators of its columns (column -> DataOperator) where the default one does not fit."""
        return {}

    def negatives(self, values: Mapping[str, Any]) -> dict[str, Any]:
        """Values the unguided side of classifier-free guidance sees in place of this feature's inputs."""
        return {}

    def denoise(self, pipe, call) -> None:
        """Its part of one denoiser call: add to `call` (the family's call object, with its named hook points)."""

    def row_values(self, pipe, data: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
        """Its columns of one training row as pipeline inputs (one-line errors naming the row); `values`: the row's
        values so far (its size). By default each column the row has, by its kind (`inputs`)."""
        return pipe.feature_data({"_row": data.get("_row", "?"), **{n: data.get(n) for n in self.inputs}},
                                 values.get("num_frames"))

    def call_values(self, given: Mapping[str, Any], values: Mapping[str, Any]) -> tuple[dict[str, Any], dict]:
        """Its inputs of a sampling call (`given`, by the reference's names) -> (values for its units, settings of
        the denoiser call); `values`: the call's so far (batch_size, negative_prompt). By default the inputs as
        given."""
        return {name: given.get(name) for name in self.call_inputs if name not in self.call_settings}, {}

    def sample_values(self, flags: Mapping[str, Any]) -> dict[str, Any]:
        """`difftune sample`'s flags (image flags loaded; the family's options too) -> its sampling inputs: by
        default each of its `flags` given, under its own name."""
        return given_inputs(self.flags, flags)

    def check_values(self, values: dict[str, Any], where: str) -> None:
        """A training row's values, its columns checked together (in place; one line naming the row, `where`)."""

    def prepare_call(self, pipe, values: dict[str, Any], cfg_scale: float, state: dict[str, Any]) -> None:
        """A sampling call's values before the units run (in place): e.g. inputs turned into other features' inputs;
        `state` is kept for `finish_output`."""

    def finish_output(self, outputs, output_type: str, state: Mapping[str, Any]):
        """The call's outputs after decoding (e.g. a pasted half taken back out)."""
        return outputs

    def signature(self, sample: Mapping[str, Any]) -> tuple:
        """What samples encoded in one stage-1 batch must share of its columns: by default their sizes."""
        return tuple(_sizes(sample.get(name)) for name in self.inputs)

    def batch_values(self, values: dict[str, Any], samples: int) -> None:
        """Its values of a stage-1 batch of `samples` samples, put in their batched form (in place)."""

    def finish(self, pipe, latents, values: Mapping[str, Any]):
        """The sampled latents after this feature (e.g. leading reference frames dropped before decoding)."""
        return latents


def given_inputs(declared: Mapping[str, Mapping[str, Any]], flags: Mapping[str, Any]) -> dict[str, Any]:
    """The `declared` sampling flags given among `flags`, by their inputs' names."""
    return {spec.get("input") or name: flags[name] for name, spec in declared.items() if flags.get(name) is not None}


def _sizes(value):
    """An image's size, a list's sizes; anything else as it is."""
    if isinstance(value, list):
        return tuple(_sizes(v) for v in value)
    shape = getattr(value, "shape", None)  # a tensor or an array
    if shape is not None:
        return tuple(shape)
    size = getattr(value, "size", None)  # an image
    return size if isinstance(size, tuple) else value


def compose_units(base: Sequence, features: Sequence[Feature]) -> list:
    """The pipeline's units: the base units in their order, then each feature's units in feature order. A unit that
    names units it runs `before` goes right before the first of them listed so far; a unit that stands in for another
    (`replaces`) goes right after it when every value it reads that a unit writes is written by then; every other
    unit goes at the end. Each unit serves its feature (`unit.feature`)."""
    units = list(base)
    for feature in features:
        for unit in feature.units:
            if any(u.name == unit.name for u in units):
                continue  # listed by the pipeline itself already
            if unit.feature == BASE:
                unit.feature = feature.name
            elif unit.feature != feature.name:
                raise TypeError(f"{unit.name} serves {unit.feature!r}, but feature {feature.name!r} lists it")
            units.insert(_place(units, unit), unit)
    return units


def _place(units: list, unit) -> int:
    ahead = [i for i, u in enumerate(units) if u.name in getattr(unit, "before", ())]
    if ahead:
        return ahead[0]
    replaced = [i for i, u in enumerate(units) if u.name in unit.replaces or set(u.replaces) & set(unit.replaces)]
    if not replaced:
        return len(units)
    at = max(replaced) + 1
    needed = set(unit.reads())
    if any(needed & set(u.writes()) for u in units[at:]):
        return len(units)
    return at


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


__all__ = ["ALIGNED_AUDIO", "ALIGNED_FRAMES", "BASE", "FRAMES", "IMAGE", "IMAGES", "KINDS", "RAW", "VALUE", "Feature", "RunContext",
           "compose_units", "describe", "model_config", "resolve_features"]
