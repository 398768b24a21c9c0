"""Which model a set of weight files is, and building it (diffusers / transformers classes).

Recognition, for the files of one component:
  (a) a `config.json` beside the weights names the class (diffusers `_class_name`, transformers
      `architectures`) and gives the config;
  (b) else the safetensors headers (names and shapes only, no tensor is read) must equal those of a known
      official config of a registered `ComponentSpec` (the reference does the same with an MD5 of names
      and shapes); key-layout variants (ComfyUI prefixes, older/newer transformers) are normalised first;
  (c) else a one-line `UserError` naming the files and what was expected.
A model family adds its components by calling `register_spec` (see `qwen_image.py`).

Loading builds the model with empty (meta) parameters, so a 20B model is never initialised in memory, then
assigns each tensor, cast to the target dtype and moved to the device, shard by shard. Only safetensors are
read; pickle checkpoints are refused because unpickling runs code.
"""

from __future__ import annotations

import importlib
import inspect
import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError
from .config import ModelConfig
from .download import PICKLE_SUFFIXES, missing_shards

MAX_HEADER_BYTES = 100 * 1024 * 1024


# -- files and headers ----------------------------------------------------------------------------------

def _files_desc(files: list[str]) -> str:
    return files[0] if len(files) == 1 else f"{files[0]} (+{len(files) - 1} more)"


def read_header(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON header of a safetensors file, checked against the file's size (catches truncation)."""
    path = str(path)
    if path.lower().endswith(PICKLE_SUFFIXES):
        raise UserError(f"{path}: refusing to load a pickle checkpoint (loading one can run arbitrary code); "
                        f"use the model's .safetensors files or convert this one")
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            head = f.read(8)
            n = int.from_bytes(head, "little") if len(head) == 8 else -1
            if n <= 1 or n > min(size - 8, MAX_HEADER_BYTES):
                raise UserError(f"{path}: not a safetensors file (no valid header; {size} bytes)")
            raw = f.read(n)
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except IsADirectoryError:
        raise UserError(f"{path}: is a directory, expected a .safetensors file") from None
    try:
        header = json.loads(raw)
        if not isinstance(header, dict):
            raise ValueError("not an object")
        end = 0
        for key, info in header.items():
            if key == "__metadata__":
                continue
            begin, stop = info["data_offsets"]
            if not isinstance(info["dtype"], str) or not all(isinstance(d, int) and d >= 0 for d in info["shape"]) \
                    or not 0 <= begin <= stop:
                raise ValueError(f"bad entry {key}")
            end = max(end, stop)
    except (ValueError, KeyError, TypeError) as e:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        raise UserError(f"{path}: not a safetensors file (its header is not valid: {type(e).__name__})") from None
    if 8 + n + end > size:
        raise UserError(f"{path}: truncated safetensors file ({size} bytes, its header describes {8 + n + end}); "
                        f"download it again")
    return header


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
        shapes = header_shapes(read_header(f))
        for key in shapes:
            if key in seen and seen[key] != f:
                raise UserError(f"{f}: tensor {key} is also in {seen[key]} (two copies of one model?)")
            seen[key] = f
        out[f] = shapes
    return out


# -- the registry ---------------------------------------------------------------------------------------

def _identity(key: str) -> str:
    return key


@dataclass
class ComponentSpec:
    """One model class a pipeline slot can hold, with the official configs recognisable from bare weights."""

    name: str  # the pipeline slot: dit, text_encoder, vae
    library: str  # "diffusers" or "transformers"
    class_name: str
    config_class_name: str | None = None  # transformers config class
    known_configs: dict[str, dict] = field(default_factory=dict)  # label -> the official config.json contents
    marker_keys: tuple[str, ...] = ()  # normalised keys every checkpoint of this class has (a cheap pre-filter)
    normalize_key: Callable[[str], str] = _identity  # file key -> model key (idempotent)
    description: str = ""

    def model_class(self):
        return getattr(importlib.import_module(self.library), self.class_name)

    def build(self, config: dict) -> torch.nn.Module:
        """The model with parameters on the meta device (buffers real: they are computed, not loaded)."""
        from accelerate import init_empty_weights

        cls = self.model_class()
        with init_empty_weights(include_buffers=False):
            if self.library == "transformers":
                cfg = getattr(importlib.import_module("transformers"), self.config_class_name).from_dict(dict(config))
                return cls(cfg)
            init = set(inspect.signature(cls.__init__).parameters)
            return cls.from_config({k: v for k, v in config.items() if k.startswith("_") or k in init})

    def signature(self, config: dict) -> dict[str, tuple[int, ...]]:
        key = (self.library, self.class_name, json.dumps(config, sort_keys=True, default=str))
        if key not in _SIGNATURES:
            _SIGNATURES[key] = {k: tuple(v.shape) for k, v in self.build(config).state_dict().items()}
        return _SIGNATURES[key]


_SPECS: list[ComponentSpec] = []
_SIGNATURES: dict[tuple, dict[str, tuple[int, ...]]] = {}


def register_spec(spec: ComponentSpec) -> ComponentSpec:
    if not any(s is spec for s in _SPECS):
        _SPECS.append(spec)
    return spec


def specs() -> list[ComponentSpec]:
    from . import qwen_image  # noqa: F401  (registers the built-in specs)

    return list(_SPECS)


def component_names() -> list[str]:
    return list(dict.fromkeys(s.name for s in specs()))


@dataclass
class HeaderMatch:
    spec: ComponentSpec
    label: str
    config: dict


def match_header(header: dict[str, Any]) -> HeaderMatch | None:
    """The registered spec and known config whose tensor names and shapes equal `header`'s, if any.

    `header` is a safetensors header, or a {name: shape} dict (several shards merged).
    """
    shapes = header_shapes(header)
    for spec in specs():
        mapped = {spec.normalize_key(k): s for k, s in shapes.items()}
        if not all(m in mapped for m in spec.marker_keys):
            continue
        for label, config in spec.known_configs.items():
            if spec.signature(config) == mapped:
                return HeaderMatch(spec, label, config)
    return None


def _near_miss(header: dict[str, Any]) -> str:
    """Why the closest registered spec did not match, for the error message ('' if nothing is close)."""
    shapes = header_shapes(header)
    best = None
    for spec in specs():
        mapped = {spec.normalize_key(k): s for k, s in shapes.items()}
        if not spec.marker_keys or not all(m in mapped for m in spec.marker_keys):
            continue
        for label, config in spec.known_configs.items():
            sig = spec.signature(config)
            wrong = [k for k in mapped if k in sig and sig[k] != mapped[k]]
            missing = [k for k in sig if k not in mapped]
            extra = [k for k in mapped if k not in sig]
            score = len(wrong) + len(missing) + len(extra)
            if best is None or score < best[0]:
                if wrong:
                    example = f"{wrong[0]} is {list(mapped[wrong[0]])}, {label} has {list(sig[wrong[0]])}"
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


def _weight_files(config: ModelConfig) -> list[str]:
    resolved = config.resolve()
    if isinstance(resolved, str):
        raise UserError(f"{resolved}: no weight files (.safetensors) in this folder; point at one component's "
                        f"folder (such as transformer/ of a diffusers repository) or at its files")
    return [str(f) for f in resolved]


def _config_beside(files: list[str]) -> tuple[ComponentSpec, dict, str] | None:
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
    for spec in specs():
        if spec.class_name in classes:
            return spec, config, str(path)
    known = ", ".join(sorted({s.class_name for s in specs()}))
    raise UserError(f"{path}: {classes[0]} is not a model difftune can load here (known: {known})")


def detect_component(config: ModelConfig | str | list[str]) -> DetectedComponent:
    """Which registered component the weights of `config` are, and the config to build it from."""
    config = as_model_config(config)
    files = _weight_files(config)
    per_file = check_files(files)
    shapes = {k: s for f in per_file.values() for k, s in f.items()}
    key_file = {k: f for f, keys in per_file.items() for k in keys}
    beside = _config_beside(files)
    if beside is not None:
        spec, model_config, path = beside
        return DetectedComponent(spec.name, spec, model_config, files, path, shapes, key_file)
    match = match_header(shapes)
    if match is not None:
        return DetectedComponent(match.spec.name, match.spec, dict(match.config), files,
                                 f"weights match {match.label}", shapes, key_file)
    expected = "; ".join(f"{s.name}: {s.class_name} ({', '.join(s.known_configs)})" for s in specs())
    hint = _near_miss(shapes)
    raise UserError(f"{_files_desc(files)}: unknown architecture ({len(shapes)} tensors, no config.json beside them"
                    f"{'; ' + hint if hint else ''}); expected one of {expected}, or put the model's config.json "
                    f"beside the weights")


# -- loading --------------------------------------------------------------------------------------------

@dataclass
class LoadedComponent:
    name: str
    module: torch.nn.Module
    files: list[str]
    source: str = ""


def as_model_config(config: ModelConfig | str | os.PathLike | list) -> ModelConfig:
    return config if isinstance(config, ModelConfig) else ModelConfig(path=config)


def _dtype(value) -> torch.dtype:
    if isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise UserError(f"torch_dtype {value!r}: not a torch dtype (e.g. bfloat16, float16, float32)")
    return dtype


def _fit_errors(det: DetectedComponent, expected: dict[str, tuple[int, ...]], required: set[str]) -> str | None:
    """Missing / unexpected / mis-shaped tensors, from the headers alone (before any tensor is read)."""
    norm = det.spec.normalize_key
    mapped = {norm(k): k for k in det.shapes}
    unexpected = [k for n, k in mapped.items() if n not in expected]
    wrong = [k for n, k in mapped.items() if n in expected and tuple(det.shapes[k]) != expected[n]]
    missing = [n for n in expected if n in required and n not in mapped]
    if not (unexpected or wrong or missing):
        return None
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing (e.g. {', '.join(missing[:3])})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected (e.g. {', '.join(unexpected[:3])})")
    if wrong:
        k = wrong[0]
        parts.append(f"{len(wrong)} of the wrong shape (e.g. {k} in {det.key_file[k]} is {list(det.shapes[k])}, "
                     f"expected {list(expected[norm(k)])})")
    return f"{_files_desc(det.files)}: the weights do not fit {det.spec.class_name} (from {det.source}): " \
           + "; ".join(parts)


def _required(module: torch.nn.Module) -> set[str]:
    """Tensors a checkpoint must provide: the state dict minus tied duplicates (e.g. lm_head = embeddings)."""
    return {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}


def load_component(config: ModelConfig | str | list[str], torch_dtype=torch.bfloat16,
                   device: str | torch.device = "cpu") -> LoadedComponent:
    """Recognise, build and load one model: frozen (`requires_grad=False`), `eval()`, on `device`.

    Floating tensors are cast to `torch_dtype`; with `config.fp8` (or `--fp8_models <name>`) the Linear
    weights are stored in float8_e4m3fn as they are read (see `fp8.py`).
    """
    from safetensors import safe_open

    from .fp8 import enable_fp8_storage, fp8_weight_names

    config = as_model_config(config)
    dtype = _dtype(torch_dtype)
    det = detect_component(config)
    try:
        module = det.spec.build(det.config)
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise UserError(f"{det.source}: cannot build {det.spec.class_name} from this config "
                        f"({type(e).__name__}: {first})") from e
    expected = {k: tuple(v.shape) for k, v in module.state_dict(keep_vars=True).items()}
    problem = _fit_errors(det, expected, _required(module))
    if problem:
        raise UserError(problem)
    fp8 = config.wants_fp8(det.name)
    fp8_names = set(fp8_weight_names(module)) if fp8 else set()
    keep_fp32 = tuple(getattr(module, "_keep_in_fp32_modules", None) or ())
    for f in det.files:
        batch = {}
        with safe_open(f, framework="pt", device="cpu") as sf:
            for key in sf.keys():
                name = det.spec.normalize_key(key)
                tensor = sf.get_tensor(key)
                if tensor.is_floating_point():
                    target = torch.float8_e4m3fn if name in fp8_names else \
                        torch.float32 if any(m in name.split(".") for m in keep_fp32) else dtype
                    tensor = tensor.to(target)
                batch[name] = tensor.to(device)
        module.load_state_dict(batch, strict=False, assign=True)
        del batch
    if hasattr(module, "tie_weights"):
        module.tie_weights()
    left = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    if left:
        raise UserError(f"{_files_desc(det.files)}: no weights for {len(left)} tensors of {det.spec.class_name} "
                        f"(e.g. {', '.join(left[:3])})")
    module.to(device)  # computed buffers
    if fp8:
        enable_fp8_storage(module, compute_dtype=dtype)
    module.requires_grad_(False)
    module.eval()
    return LoadedComponent(det.name, module, det.files, det.source)


# -- tokenizer and processor ----------------------------------------------------------------------------

def _directory(value: ModelConfig | str | os.PathLike, what: str) -> Path:
    resolved = value.resolve() if isinstance(value, ModelConfig) else os.fspath(value)
    if isinstance(resolved, list):
        resolved = os.path.dirname(resolved[0])
    path = Path(os.path.expanduser(resolved))
    if path.is_file():
        path = path.parent
    if not path.is_dir():
        raise UserError(f"{path}: no such directory (expected a {what} folder)")
    return path


def load_tokenizer(path_or_config: ModelConfig | str | os.PathLike):
    """A transformers tokenizer from a folder (e.g. Qwen-Image's `tokenizer/`)."""
    path = _directory(path_or_config, "tokenizer")
    if not any((path / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        raise UserError(f"{path}: no tokenizer here (expected tokenizer.json, tokenizer_config.json or vocab.json)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise UserError(f"{path}: cannot load the tokenizer ({type(e).__name__}: {first})") from e


class VLProcessor:
    """The image processor and tokenizer of a Qwen2-VL `processor/` folder.

    transformers' own Qwen2VLProcessor also builds a video processor, which needs torchvision; the
    pipeline only needs images. Calls and attributes (merge_size, patch_size, ...) go to the image processor.
    """

    def __init__(self, image_processor, tokenizer):
        self.image_processor = image_processor
        self.tokenizer = tokenizer

    def __call__(self, images=None, **kwargs):
        return self.image_processor(images=images, **kwargs)

    def __getattr__(self, name):
        if name.startswith("__") or name in ("image_processor", "tokenizer"):
            raise AttributeError(name)
        return getattr(self.image_processor, name)


def load_processor(path_or_config: ModelConfig | str | os.PathLike) -> VLProcessor:
    """The edit model's `processor/` folder: Qwen2-VL image processor (PIL backend) + tokenizer."""
    path = _directory(path_or_config, "processor")
    if not (path / "preprocessor_config.json").is_file():
        raise UserError(f"{path}: no preprocessor_config.json (expected the model's processor/ folder)")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    try:
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(path))
    except Exception as e:
        first = (str(e).strip().splitlines() or [""])[0]
        raise UserError(f"{path}: cannot load the image processor ({type(e).__name__}: {first})") from e
    return VLProcessor(image_processor, load_tokenizer(path))
