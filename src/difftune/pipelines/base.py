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

from collections.abc import Iterable, Mapping
from typing import Any

import torch
from tqdm.auto import tqdm

from ..errors import UndeclaredIOError, UserError


class PipelineUnit:
    """One pre-processing step. Subclasses set the declarations and implement `process`."""

    inputs: tuple[str, ...] = ()
    outputs: tuple[str, ...] = ()
    cfg_inputs: Mapping[str, tuple[str, str]] = {}
    cfg_outputs: Mapping[str, tuple[str, str]] = {}
    models: tuple[str, ...] = ()

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

    def __init__(self, pipe: BasePipeline, unit: PipelineUnit):
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


def run_unit(pipe: BasePipeline, unit: PipelineUnit, values: dict[str, Any], cfg: bool = False) -> dict[str, Any]:
    """Run one unit on `values` in place: give it exactly its declared inputs, check and merge its outputs."""
    sides = (0, 1) if (cfg and (unit.cfg_inputs or unit.cfg_outputs)) else (0,)
    view = _ModelView(pipe, unit)
    allowed = set(unit.outputs) | set(unit.cfg_outputs)
    for side in sides:
        kwargs = {n: values.get(n) for n in unit.inputs}
        kwargs.update({arg: values.get(names[side]) for arg, names in unit.cfg_inputs.items()})
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


class BasePipeline:
    """Models by name, device and dtype, the units, `freeze_except`, and the sampling loop.

    Families subclass it and set `model_names`, `units`, `model_fn` and `model_fn_inputs`.
    """

    model_names: tuple[str, ...] = ()
    # Names that are run-time settings, not data: supplied by each stage's own arguments, never cached.
    settings: frozenset[str] = frozenset()
    # Names `model_fn` reads from the values besides `latents` and `timestep`.
    model_fn_inputs: tuple[str, ...] = ()
    # Variable-length values and their masks: padded to a common length when samples are batched.
    padded_values: Mapping[str, str] = {}
    # Models `model_fn` uses (the denoiser): stage 2 always loads them.
    loss_models: tuple[str, ...] = ()
    # Training images are cropped so both sides are multiples of this.
    division_factor: int = 1

    def __init__(self, device: str | torch.device = "cpu", torch_dtype: torch.dtype = torch.float32):
        self.device = torch.device(device)
        self.torch_dtype = torch_dtype
        self.models: dict[str, torch.nn.Module | None] = {name: None for name in self.model_names}
        self.units: list[PipelineUnit] = []
        self.scheduler = None

    # -- models by name -------------------------------------------------------------------------------
    def __getattr__(self, name: str):
        models = self.__dict__.get("models")
        if models is not None and name in models:
            return models[name]
        raise AttributeError(f"{type(self).__name__} has no attribute '{name}'")

    def __setattr__(self, name: str, value):
        if name in type(self).model_names and "models" in self.__dict__:
            self.models[name] = value
        else:
            object.__setattr__(self, name, value)

    def loaded_models(self) -> dict[str, torch.nn.Module]:
        return {k: v for k, v in self.models.items() if v is not None}

    def free_models(self, names: Iterable[str]) -> None:
        """Drop models (e.g. the stage-1 encoders before stage 2 starts)."""
        for name in names:
            self.models[name] = None

    def freeze_except(self, names: Iterable[str]) -> None:
        """Eval mode and no gradients for every model, except the named ones (train mode, gradients on)."""
        names = set(n for n in names if n)
        unknown = names - set(self.model_names)
        if unknown:
            raise UserError(f"--trainable_models: unknown model(s) {sorted(unknown)}; "
                            f"this pipeline has {list(self.model_names)}")
        for name, model in self.loaded_models().items():
            train = name in names
            model.train(train)
            model.requires_grad_(train)

    # -- units ----------------------------------------------------------------------------------------
    def run_units(self, values: dict[str, Any], units: Iterable[PipelineUnit] | None = None,
                  cfg: bool = False) -> dict[str, Any]:
        for unit in self.units if units is None else units:
            run_unit(self, unit, values, cfg=cfg)
        return values

    def model_fn_kwargs(self, values: Mapping[str, Any]) -> dict[str, Any]:
        return {k: values.get(k) for k in self.model_fn_inputs}

    def model_fn(self, **kwargs) -> torch.Tensor:  # pragma: no cover - abstract
        raise NotImplementedError

    def combine_cfg(self, posi: torch.Tensor, nega: torch.Tensor, cfg_scale: float) -> torch.Tensor:
        return nega + cfg_scale * (posi - nega)

    # -- sampling -------------------------------------------------------------------------------------
    @torch.no_grad()
    def denoise(self, values: dict[str, Any], cfg_scale: float = 1.0, progress: bool = True,
                settings: Mapping[str, Any] | None = None) -> torch.Tensor:
        """The sampling loop: `model_fn` over the scheduler's timesteps, with classifier-free guidance."""
        latents = values["latents"]
        settings = dict(settings or {})
        posi = self.model_fn_kwargs(values)
        nega = None
        if cfg_scale != 1.0:
            nega = {k: values.get(self.negative_name(k), v) for k, v in posi.items()}
        timesteps = self.scheduler.timesteps
        for i in tqdm(range(len(timesteps)), disable=not progress, desc="sampling", leave=False):
            t = timesteps[i].expand(latents.shape[0]).to(self.device)
            pred = self.model_fn(**posi, **settings, latents=latents, timestep=t)
            if nega is not None:
                pred_nega = self.model_fn(**nega, **settings, latents=latents, timestep=t)
                pred = self.combine_cfg(pred, pred_nega, cfg_scale)
            latents = self.scheduler.step(pred, i, latents)
        return latents

    # -- training data (families override `training_inputs`; the rest have working defaults) ---------
    def training_inputs(self, data: dict[str, Any]) -> dict[str, Any]:  # pragma: no cover - abstract
        """Pipeline inputs for one data sample, as inference would be called with (batch of one)."""
        raise NotImplementedError

    def batch_signature(self, sample: dict[str, Any]):
        """Stage 1 encodes samples with equal signatures as one batch; None (the default): one at a time."""
        return None

    def training_inputs_batch(self, samples: list[dict[str, Any]]) -> dict[str, Any]:
        """Pipeline inputs for samples of one signature; needed only if `batch_signature` returns one."""
        if len(samples) != 1:
            raise NotImplementedError(f"{type(self).__name__} defines batch_signature but not training_inputs_batch")
        return self.training_inputs(samples[0])

    def from_cache_values(self, sample: dict[str, Any]) -> dict[str, Any]:
        """Values read back from a stage-1 cache: images come back as PIL, bookkeeping keys are dropped."""
        from .images import images_from_cache

        return {k: images_from_cache(v) for k, v in sample.items() if not k.startswith("_")}

    def negative_name(self, name: str) -> str:
        """The namespace name of the negative-prompt version of a model_fn input."""
        for unit in self.units:
            for pair in unit.cfg_outputs.values():
                if pair[0] == name:
                    return pair[1]
        return name


def collate_values(samples: list[dict[str, Any]], padded: Mapping[str, str]) -> dict[str, Any]:
    """Batch per-sample values (no batch dimension) into one dict (leading batch dimension).

    Names in `padded` are variable-length sequences (dim 0) padded with zeros to the longest, their
    masks (the mapped names) padded with zeros; other tensors must have equal shapes and are stacked;
    non-tensors become lists.
    """
    out: dict[str, Any] = {}
    keys = samples[0].keys()
    masks = set(padded.values())
    for key in keys:
        vals = [s.get(key) for s in samples]
        if key in masks:
            continue
        if all(v is None for v in vals):
            out[key] = None
        elif all(isinstance(v, torch.Tensor) for v in vals):
            if key in padded:
                length = max(v.shape[0] for v in vals)
                out[key] = torch.stack([torch.nn.functional.pad(v, (0, 0) * (v.dim() - 1) + (0, length - v.shape[0]))
                                        for v in vals])
                mask_key = padded[key]
                if all(isinstance(s.get(mask_key), torch.Tensor) for s in samples):
                    out[mask_key] = torch.stack([
                        torch.nn.functional.pad(s[mask_key], (0, length - s[mask_key].shape[0])) for s in samples])
            else:
                shapes = {tuple(v.shape) for v in vals}
                if len(shapes) > 1:
                    raise ValueError(f"cannot batch '{key}' with different shapes {sorted(shapes)}")
                out[key] = torch.stack(vals)
        else:
            out[key] = vals
    return out


def split_batch(values: dict[str, Any], batch_size: int, padded: Mapping[str, str],
                names: Iterable[str]) -> list[dict[str, Any]]:
    """The inverse of `collate_values` for the given names: one dict per sample, padding removed."""
    samples: list[dict[str, Any]] = [{} for _ in range(batch_size)]
    masks = set(padded.values())
    for key in names:
        value = values.get(key)
        for i in range(batch_size):
            if isinstance(value, torch.Tensor) and value.dim() > 0 and value.shape[0] == batch_size:
                item = value[i]
                if key in padded and isinstance(values.get(padded[key]), torch.Tensor):
                    item = item[: int(values[padded[key]][i].sum())]
                elif key in masks:
                    item = item[: int(item.sum())]
                samples[i][key] = item
            elif isinstance(value, list) and len(value) == batch_size:
                samples[i][key] = value[i]
            else:
                samples[i][key] = value
    return samples
