"""Which model a set of weight files is, and building it (diffusers / transformers classes).

Recognition, for the files of one component:
  (a) a `config.json` beside the weights names the class (diffusers `_class_name`, transformers
      `architectures`) and gives the config;
  (b) else the safetensors headers (names and shapes only, no tensor is read) must equal those of a known
      official config of a registered `ComponentSpec` (the reference does the same with an MD5 of names
      and shapes); key-layout variants (ComfyUI prefixes, older/newer transformers) are normalised first;
  (c) else a one-line `UserError` naming the files and what was expected.
The candidates are one family's components (`FamilySpec.components`); recognition never looks across families
(`core/family.py` infers the family first).

Loading builds the model with empty (meta) parameters, so a 20B model is never initialised in memory, then
assigns each tensor, cast to the target dtype and moved to the device, shard by shard. Only safetensors are
read; pickle checkpoints are refused because unpickling runs code.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from .config import ModelConfig
from .download import missing_shards
from .prequant import logical_shapes



# -- files and headers ----------------------------------------------------------------------------------

SIZES_IN_WEIGHTS = "the sizes in the weights"  # the label of a config read off the tensors (infer_config)


def _files_desc(files: list[str]) -> str:
    return files[0] if len(files) == 1 else f"{files[0]} (+{len(files) - 1} more)"


def read_header(path: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} of a weight file. A safetensors file from its header alone (safetensors checks that
    the header is valid and that the file covers every tensor it describes, which catches truncation); a `.pth`
    state dict memory-mapped through `torch.load(weights_only=True)` (models/files.py)."""
    from safetensors import SafetensorError, safe_open

    from .files import is_state_dict_pickle, load_pth, refuse_pickle

    path = str(path)
    refuse_pickle(path)
    if is_state_dict_pickle(path):
        return {k: tuple(v.shape) for k, v in load_pth(path).items()}
    if os.path.isdir(path):
        raise UserError(f"{path}: is a directory, expected a .safetensors file")
    if not os.path.exists(path):
        raise UserError(f"{path}: no such file")
    try:
        with safe_open(path, framework="pt", device="cpu") as f:
            return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except SafetensorError as e:
        reason = str(e).removeprefix("Error while deserializing header: ")
        if "not fully covered" in reason:
            raise UserError(f"{path}: truncated safetensors file ({os.path.getsize(path)} bytes, fewer than its "
                            f"header describes); download it again") from None
        raise UserError(f"{path}: not a safetensors file (its header is not valid: {reason})") from None


def header_shapes(header: dict[str, Any]) -> dict[str, tuple[int, ...]]:
    """{tensor name: shape} from a safetensors header (or from an already simplified {name: shape} dict)."""
    return {k: tuple(v["shape"] if isinstance(v, dict) else v) for k, v in header.items() if k != "__metadata__"}


def check_files(files: list[str]) -> dict[str, dict[str, tuple[int, ...]]]:
    """{file: {tensor: shape}} for a component's weight files, after checking they are whole safetensors."""
    for path, why in missing_shards(files):
        raise UserError(f"{path}: missing shard ({why})")
    out = {}
    seen: dict[str, str] = {}
    for f in files:
        # a pre-quantised file (models/prequant.py) shows its weights at their own shapes, not packed
        shapes = logical_shapes(f, header_shapes(read_header(f)))
        for key in shapes:
            if key in seen and seen[key] != f:
                raise UserError(f"{f}: tensor {key} is also in {seen[key]} (two copies of one model?)")
            seen[key] = f
        out[f] = shapes
    return out


# -- the registry ---------------------------------------------------------------------------------------

def strip_comfyui_prefix(key: str) -> str:
    """A `normalize_key` for DiT files ComfyUI (and other tools) save behind `model.diffusion_model.` or
    `diffusion_model.` in front of the model's own names."""
    for prefix in ("model.diffusion_model.", "diffusion_model."):
        if key.startswith(prefix):
            return key[len(prefix):]
    return key


def _identity(key: str) -> str:
    return key


@dataclass
class ComponentSpec:
    """One model class a pipeline slot can hold, with the official configs recognisable from bare weights."""

    name: str  # the pipeline slot it fills: dit, text_encoder, vae
    library: str  # "diffusers" or "transformers"
    class_name: str
    config_class_name: str | None = None  # transformers config class
    known_configs: dict[str, dict] = field(default_factory=dict)  # label -> the official config.json contents
    marker_keys: tuple[str, ...] = ()  # normalised keys every checkpoint of this class has (a cheap pre-filter)
    normalize_key: Callable[[str], str] = _identity  # file key -> model key (idempotent)
    description: str = ""
    extra_slots: tuple[str, ...] = ()  # further slots a second model of this class fills (e.g. dit2)
    # Classes of config.json files that may sit beside this spec's weights without describing them in diffusers' or
    # transformers' terms (Wan-AI's own "WanModel" config beside its DiT): the weights are recognised instead.
    foreign_config_classes: tuple[str, ...] = ()
    # Whole-checkpoint layout conversion (normalised keys -> model keys) for layouts that cannot be mapped key by
    # key (fused tensors split). It must work on meta tensors: recognition runs it on the header's shapes.
    convert_state_dict: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None
    # For a model whose every size shows in its weights: {model key: shape} -> its config (None: not this model).
    # Tried after `known_configs`, so bare files of any depth/width are recognised.
    infer_config: Callable[[dict[str, tuple[int, ...]]], dict | None] | None = None
    # A model released inside another model's file (a VACE branch in its DiT's checkpoint): recognised on the same
    # files after (or instead of) the main model, filling its own slot. Its `convert_state_dict` / `normalize_key`
    # take its own tensors out of the file, and the main model's spec leaves them aside.
    companion: bool = False
    # Further config.json classes that describe this spec's model: its class is built from their config as it is
    # (a half of a VAE from the whole VAE's config in a diffusers folder).
    config_classes: tuple[str, ...] = ()
    # A config.json of this spec's class -> why it is not this spec's model (one class, two families' models: an
    # SDXL UNet is a UNet2DConditionModel too), or None
    config_problem: Callable[[dict], str | None] | None = None

    def candidate_configs(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, dict]:
        """label -> config to match weights of normalised {key: shape} against."""
        configs = dict(self.known_configs)
        inferred = self.inferred_config(shapes)
        if isinstance(inferred, dict) and inferred not in configs.values():
            configs[SIZES_IN_WEIGHTS] = inferred
        return configs

    def inferred_config(self, shapes: dict[str, tuple[int, ...]]) -> dict | str | None:
        """The config the sizes in the weights give (`infer_config`); the name of a tensor it reads that is missing
        (a cut file: a KeyError before), or None."""
        if self.infer_config is None:
            return None
        try:
            return self.infer_config(shapes)
        except KeyError as e:
            return str(e.args[0]) if e.args else None
        except (ValueError, TypeError, IndexError, ZeroDivisionError):  # sizes of another model's tensors (a 4-D
            return None  # patch embedding where a Linear's two sizes are read): not this model

    def model_class(self):
        return getattr(importlib.import_module(self.library), self.class_name)

    def build(self, config: dict) -> torch.nn.Module:
        """The model with parameters on the meta device (buffers real: they are computed, not loaded)."""
        from accelerate import init_empty_weights

        cls = self.model_class()
        if self.library == "transformers":
            from transformers.initialization import no_init_weights

            cfg = getattr(importlib.import_module("transformers"), self.config_class_name).from_dict(dict(config))
            # transformers initialises the (meta) parameters it builds unless the device is meta, and torch's meta
            # normal_ runs in Python: a tenth of a tiny training run went there. The weights are loaded next.
            with init_empty_weights(include_buffers=False), no_init_weights():
                model = cls(cfg)
            # tied embeddings (T5's shared / embed_tokens) are tied on load, not on construction: tie them
            # here so a checkpoint that stores one copy fits
            model.tie_weights()
            return model
        with init_empty_weights(include_buffers=False):
            init = set(inspect.signature(cls.__init__).parameters)
            return cls.from_config({k: v for k, v in config.items() if k.startswith("_") or k in init})

    def signature(self, config: dict) -> dict[str, tuple[int, ...]]:
        return self._signature(config)[0]

    def tied(self, config: dict) -> frozenset[str]:
        """State-dict names that repeat a tied tensor (T5's encoder.embed_tokens = shared): a checkpoint may
        leave them out."""
        return self._signature(config)[1]

    def _signature(self, config: dict):
        key = (self.library, self.class_name, json.dumps(config, sort_keys=True, default=str))
        if key not in _SIGNATURES:
            model = self.build(config)
            own = {n for n, _ in model.named_parameters()} | {n for n, _ in model.named_buffers()}
            shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
            _SIGNATURES[key] = (shapes, frozenset(shapes) - own)
        return _SIGNATURES[key]

    def model_shapes(self, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]] | None:
        """{model key: shape} of checkpoint tensors {file key: shape}, from the header alone (None when the
        converter rejects the layout)."""
        mapped = {self.normalize_key(k): s for k, s in shapes.items()}
        if self.convert_state_dict is None:
            return mapped
        try:
            out = self.convert_state_dict({k: torch.empty(s, device="meta") for k, s in mapped.items()})
        except (KeyError, IndexError, ValueError, RuntimeError):
            return None
        return {k: tuple(v.shape) for k, v in out.items()}

    def fits(self, config: dict, shapes: dict[str, tuple[int, ...]]) -> bool:
        """Whether checkpoint tensors {name: shape} are exactly this config's (tied repeats optional)."""
        sig = self.signature(config)
        return all(sig.get(k) == s for k, s in shapes.items()) and set(sig) - set(shapes) <= self.tied(config)


_SIGNATURES: dict[tuple, tuple[dict[str, tuple[int, ...]], frozenset[str]]] = {}


@dataclass
class HeaderMatch:
    spec: ComponentSpec
    label: str
    config: dict


def match_header(header: dict[str, Any], specs: Sequence[ComponentSpec]) -> HeaderMatch | None:
    """The registered spec and known config whose tensor names and shapes equal `header`'s, if any.

    `header` is a safetensors header, or a {name: shape} dict (several shards merged).
    """
    shapes = header_shapes(header)
    for spec in specs:
        mapped = {spec.normalize_key(k): s for k, s in shapes.items()}
        if not all(m in mapped for m in spec.marker_keys):
            continue
        mapped = spec.model_shapes(shapes) if spec.convert_state_dict else mapped
        if mapped is None:
            continue
        for label, config in spec.candidate_configs(mapped).items():
            if spec.fits(config, mapped):
                return HeaderMatch(spec, label, config)
    return None


def _near_miss(header: dict[str, Any], specs: Sequence[ComponentSpec]) -> str:
    """Why the closest registered spec did not match, for the error message ('' if nothing is close)."""
    shapes = header_shapes(header)
    best = None
    for spec in specs:
        mapped = {spec.normalize_key(k): s for k, s in shapes.items()}
        if not spec.marker_keys or not all(m in mapped for m in spec.marker_keys):
            continue
        mapped = spec.model_shapes(shapes) if spec.convert_state_dict else mapped
        if mapped is None:
            continue
        inferred = spec.inferred_config(mapped)
        if isinstance(inferred, str):  # the sizes are read from a tensor that is missing
            return f"it looks like a {spec.class_name} ({spec.name}) with the tensor {inferred} missing"
        configs = dict(spec.known_configs)
        if isinstance(inferred, dict):
            configs[SIZES_IN_WEIGHTS] = inferred
        for label, config in configs.items():
            try:
                sig = spec.signature(config)
            except Exception:  # sizes read off a cut file may build no model
                continue
            wrong = [k for k in mapped if k in sig and sig[k] != mapped[k]]
            missing = [k for k in sig if k not in mapped and k not in spec.tied(config)]
            extra = [k for k in mapped if k not in sig]
            score = len(wrong) + len(missing) + len(extra)
            if best is None or score < best[0]:
                if wrong:
                    example = f"{wrong[0]} is {list(mapped[wrong[0]])}, {label} has {list(sig[wrong[0]])}"
                elif missing and label == SIZES_IN_WEIGHTS:  # every size fits: the file lacks tensors
                    best = (score, f"it looks like a {spec.class_name} ({spec.name}) with {len(missing)} tensor"
                                   f"{'s' if len(missing) > 1 else ''} missing: {', '.join(missing[:3])}"
                                   f"{' ...' if len(missing) > 3 else ''}")
                    continue
                elif missing:
                    example = f"{len(missing)} tensors of {label} are absent, e.g. {missing[0]}"
                else:
                    example = f"{len(extra)} tensors are not in {label}, e.g. {extra[0]}"
                best = (score, f"it looks like a {spec.class_name} ({spec.name}) but not a known config: {example}")
    return best[1] if best else ""


# -- recognition ----------------------------------------------------------------------------------------

@dataclass
class DetectedComponent:
    name: str
    spec: ComponentSpec
    config: dict  # what the model is built from
    files: list[str]
    source: str  # "<dir>/config.json" or "weights match <label>"
    shapes: dict[str, tuple[int, ...]] = field(repr=False, default_factory=dict)  # {file key: shape}
    key_file: dict[str, str] = field(repr=False, default_factory=dict)  # {file key: file}

    def describe(self) -> str:
        """The files, as a message names them."""
        return _files_desc(self.files)


def _weight_files(config: ModelConfig) -> list[str]:
    resolved = config.resolve()
    if isinstance(resolved, str):
        raise UserError(f"{resolved}: no weight files (.safetensors) in this folder; point at one component's "
                        f"folder (such as transformer/ of a diffusers repository) or at its files")
    return [str(f) for f in resolved]


def _config_beside(files: list[str], specs: Sequence[ComponentSpec],
                   shapes: dict[str, tuple[int, ...]] | None = None) -> tuple[ComponentSpec, dict, str] | None:
    path = Path(files[0]).parent / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise UserError(f"{path}: not valid JSON ({e})") from e
    if not isinstance(config, dict):
        raise UserError(f"{path}: expected a JSON object")
    classes = [config["_class_name"]] if isinstance(config.get("_class_name"), str) else []
    classes += [a for a in config.get("architectures") or [] if isinstance(a, str)]
    if not classes:
        return None  # not a diffusers/transformers model config: recognise the weights instead
    if shapes is not None and any(_carries_markers(spec, shapes) for spec in specs
                                  if any(c in spec.foreign_config_classes for c in classes)):
        return None  # e.g. a fine-tune that kept its base model's config.json beside extra tensors: the weights decide
    problems = []
    for spec in specs:
        if spec.class_name in classes or any(c in spec.config_classes for c in classes):
            problem = spec.config_problem(config) if spec.config_problem else None
            if problem is None:
                return spec, config, str(path)
            problems.append(problem)
    if problems:
        raise UserError(f"{path}: {problems[0]}")
    if any(c in spec.foreign_config_classes for spec in specs for c in classes):
        return None
    known = ", ".join(sorted({s.class_name for s in specs}))
    raise UserError(f"{path}: {classes[0]} is not a model difftune can load here (known: {known})")


def config_class(folder: str | os.PathLike) -> str | None:
    """The model class a folder's config.json names (diffusers' `_class_name`, else transformers' first
    `architectures` entry); None without a readable one (`_config_beside` names an unreadable one)."""
    try:
        config = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict):
        return None
    named = config.get("_class_name") or (config.get("architectures") or [None])[0]
    return named if isinstance(named, str) else None


def _carries_markers(spec: ComponentSpec, shapes: dict[str, tuple[int, ...]]) -> bool:
    keys = {spec.normalize_key(k) for k in shapes}
    return bool(spec.marker_keys) and all(m in keys for m in spec.marker_keys)


def detect_components(config: ModelConfig | str | list[str], specs: Sequence[ComponentSpec]) -> list[DetectedComponent]:
    """Every model of `specs` the weights of `config` hold: the main one (see `detect_component`) and any companion
    stored in the same files (`ComponentSpec.companion`); a file that holds a companion alone gives just it."""
    companions = [s for s in specs if s.companion]
    main_specs = [s for s in specs if not s.companion]
    found, error = [], None
    try:
        found.append(detect_component(config, main_specs))
    except UserError as err:
        if not companions:
            raise
        error = err
    if companions:
        det = found[0] if found else None
        files = det.files if det is not None else _weight_files(as_model_config(config))
        per_file = check_files(files) if det is None else None
        shapes = det.shapes if det is not None else {k: s for f in per_file.values() for k, s in f.items()}
        key_file = det.key_file if det is not None else {k: f for f, keys in per_file.items() for k in keys}
        named = config_class(Path(files[0]).parent)  # read once for every companion
        for spec in companions:
            described = named in (spec.class_name, *spec.config_classes)
            if described and any(d.spec.class_name == spec.class_name for d in found):
                continue  # the main detection built this model from the config.json already
            beside = _config_beside(files, [spec]) if described else None
            if beside is not None:  # a diffusers folder of the model: its config.json, not the sizes, describes it
                found.append(DetectedComponent(spec.name, spec, beside[1], files, beside[2], shapes, key_file))
                continue
            match = match_header(shapes, [spec])
            if match is not None:
                found.append(DetectedComponent(spec.name, spec, dict(match.config), files,
                                               f"weights match {match.label}", shapes, key_file))
    if not found:
        raise error
    return found


def detect_component(config: ModelConfig | str | list[str], specs: Sequence[ComponentSpec]) -> DetectedComponent:
    """Which of `specs` (one family's components) the weights of `config` are, and the config to build it from."""
    config = as_model_config(config)
    files = _weight_files(config)
    per_file = check_files(files)
    shapes = {k: s for f in per_file.values() for k, s in f.items()}
    key_file = {k: f for f, keys in per_file.items() for k in keys}
    beside = _config_beside(files, specs, shapes)
    if beside is not None:
        spec, model_config, path = beside
        return DetectedComponent(spec.name, spec, model_config, files, path, shapes, key_file)
    match = match_header(shapes, specs)
    if match is not None:
        return DetectedComponent(match.spec.name, match.spec, dict(match.config), files,
                                 f"weights match {match.label}", shapes, key_file)
    expected = "; ".join(f"{s.name}: {s.class_name} ({', '.join(s.known_configs)})" for s in specs)
    hint = _near_miss(shapes, specs)
    raise UserError(f"{_files_desc(files)}: unknown architecture ({len(shapes)} tensors, no config.json beside them"
                    f"{'; ' + hint if hint else ''}); expected one of {expected}, or put the model's config.json "
                    f"beside the weights")




def as_model_config(config: ModelConfig | str | os.PathLike | list) -> ModelConfig:
    return config if isinstance(config, ModelConfig) else ModelConfig(path=config)
