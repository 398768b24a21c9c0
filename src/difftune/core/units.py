"""Pipeline units, the unit runner and the base pipeline shared by every model family.

A family is described once as an ordered list of `PipelineUnit`s (pre-processing steps) plus a
`model_fn` (one denoiser call). Inference runs the units then loops `model_fn` over the scheduler's
steps; training runs the same units then a loss that calls `model_fn` once.

Every unit declares what it reads, what it writes and which models it uses, and the runner enforces
the declaration: a unit receives only the names it declared, may return only names it declared, and
can reach only the models it declared. The stage-1/stage-2 split (`graph.py`) is computed from these
declarations, so enforcing them is what makes the split correct by construction.

All values live in one flat namespace (a dict). Classifier-free guidance needs a positive and a
negative version of prompt-dependent values; a unit declares those as `cfg_inputs`/`cfg_outputs`,
mapping one argument name to a (positive, negative) pair of namespace names, e.g.
`prompt -> ("prompt", "negative_prompt")`, `prompt_embeds -> ("prompt_embeds", "negative_prompt_embeds")`
(diffusers' names). The negative side runs only when guidance is on.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import UndeclaredIOError, UserError


class PipelineUnit:
    """One pre-processing step. Subclasses set the declarations and implement `process`."""

    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    cfg_inputs: Mapping[str, tuple[str, str]] = {}
    cfg_outputs: Mapping[str, tuple[str, str]] = {}
    models: tuple[str, ...] = ()
    # The feature this unit serves (core/features.py): "base" units run in every run, the others only when the run
    # uses their feature.
    feature: str = "base"
    # Units (by class name) this one stands in for when its feature is active, e.g. an edit prompt encoder for the
    # plain one: both write the same values, only one runs.
    replaces: tuple[str, ...] = ()
    # Units (by class name) a feature's unit must run before: composed into a pipeline, it goes right before the
    # first of them (e.g. a unit that writes the size the shape check reads, or a condition before the prompt's).
    before: tuple[str, ...] = ()
    # How the values this unit writes batch (core/batch.py: STACK, Pad(mask), SCALAR, LIST, SAME); a cfg output
    # is named by its argument name and the rule applies to both sides. Undeclared tensors stack.
    batching: Mapping[str, Any] = {}
    # Inputs without which the unit has nothing to do: while one is None it is skipped and writes nothing.
    skip_without: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return type(self).__name__

    def reads(self, cfg: bool = True) -> tuple[str, ...]:
        """Namespace names this unit reads (the negative side only when guidance is on)."""
        sides = (0, 1) if cfg else (0,)
        return tuple(self.inputs) + tuple(names[s] for names in self.cfg_inputs.values() for s in sides)

    def writes(self, cfg: bool = True) -> tuple[str, ...]:
        sides = (0, 1) if cfg else (0,)
        return tuple(self.outputs) + tuple(names[s] for names in self.cfg_outputs.values() for s in sides)

    def process(self, pipe, **kwargs) -> dict[str, Any]:  # pragma: no cover - abstract
        raise NotImplementedError

    def __repr__(self) -> str:
        return self.name


class _ModelView:
    """What a unit sees of the pipeline: everything except the models it did not declare."""

    def __init__(self, pipe, unit: PipelineUnit):
        object.__setattr__(self, "_pipe", pipe)
        object.__setattr__(self, "_unit", unit)

    def __getattr__(self, name: str):
        pipe, unit = self._pipe, self._unit
        if name in pipe.model_names:
            if name not in unit.models:
                raise UndeclaredIOError(f"unit {unit.name} used model '{name}' without declaring it in `models`")
            model = pipe.models.get(name)
            if model is None:
                raise UserError(f"model '{name}' is needed by {unit.name} but was not loaded; add its weights to "
                                f"--model_paths / --model_id_with_origin_paths")
            return model
        if name == "models":
            return {k: v for k, v in pipe.models.items() if k in unit.models}
        return getattr(pipe, name)

    def __setattr__(self, name, value):
        raise UndeclaredIOError(f"unit {self._unit.name} tried to set pipeline attribute '{name}'")


def run_unit(pipe, unit: PipelineUnit, values: dict[str, Any], cfg: bool = False) -> dict[str, Any]:
    """Run one unit on `values` in place: give it exactly its declared inputs, check and merge its outputs."""
    sides = (0, 1) if (cfg and (unit.cfg_inputs or unit.cfg_outputs)) else (0,)
    view = _ModelView(pipe, unit)
    allowed = set(unit.outputs) | set(unit.cfg_outputs)
    for side in sides:
        kwargs = {n: values.get(n) for n in unit.inputs}
        kwargs.update({arg: values.get(names[side]) for arg, names in unit.cfg_inputs.items()})
        if any(kwargs.get(n) is None for n in unit.skip_without):
            continue
        out = unit.process(view, **kwargs)
        if out is None:
            out = {}
        undeclared = set(out) - allowed
        if undeclared:
            raise UndeclaredIOError(f"unit {unit.name} returned undeclared name(s) {sorted(undeclared)}; "
                                    f"declared outputs are {sorted(allowed)}")
        for key, value in out.items():
            if side == 1 and key in unit.outputs:
                continue  # shared outputs are taken from the positive pass only
            values[unit.cfg_outputs[key][side] if key in unit.cfg_outputs else key] = value
    return values
