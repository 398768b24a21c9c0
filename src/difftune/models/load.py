"""Building and loading one recognised model, and tokenizers.

Loading builds the model with empty (meta) parameters, so a 20B model is never initialised in memory, then
assigns each tensor, cast to the target dtype and moved to the device, shard by shard. Only safetensors are
read; pickle checkpoints are refused because unpickling runs code.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from ..errors import UserError
from ..util import first_line
from ..util import torch_dtype as to_dtype
from .config import ModelConfig
from .detect import ComponentSpec, DetectedComponent, _files_desc, as_model_config, detect_component


@dataclass
class LoadedComponent:
    name: str
    module: torch.nn.Module
    files: list[str]
    source: str = ""


def _dtype(value) -> torch.dtype:
    try:
        return to_dtype(value)
    except ValueError as e:
        raise UserError(f"torch_dtype: {e}") from None


def _fit_errors(det: DetectedComponent, expected: dict[str, tuple[int, ...]], required: set[str]) -> str | None:
    """Missing / unexpected / mis-shaped tensors, from the headers alone (before any tensor is read)."""
    if det.spec.convert_state_dict is not None:
        converted = det.spec.model_shapes(det.shapes)
        if converted is None:
            return f"{_files_desc(det.files)}: cannot convert these weights to {det.spec.class_name}'s layout"
        shapes, norm, key_file = converted, (lambda k: k), {k: _files_desc(det.files) for k in converted}
    else:
        shapes, norm, key_file = det.shapes, det.spec.normalize_key, det.key_file
    mapped = {norm(k): k for k in shapes}
    unexpected = [k for n, k in mapped.items() if n not in expected]
    wrong = [k for n, k in mapped.items() if n in expected and tuple(shapes[k]) != expected[n]]
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
        parts.append(f"{len(wrong)} of the wrong shape (e.g. {k} in {key_file[k]} is {list(shapes[k])}, "
                     f"expected {list(expected[norm(k)])})")
    return f"{_files_desc(det.files)}: the weights do not fit {det.spec.class_name} (from {det.source}): " \
           + "; ".join(parts)


def _required(module: torch.nn.Module) -> set[str]:
    """Tensors a checkpoint must provide: the state dict minus tied duplicates (e.g. lm_head = embeddings)."""
    return {n for n, _ in module.named_parameters()} | {n for n, _ in module.named_buffers()}


def _kept_in_fp32(module: torch.nn.Module, library: str, dtype) -> tuple[str, ...]:
    """Modules whose weights stay float32 at a lower `dtype`, by the class's own library's rule: transformers
    keeps `_keep_in_fp32_modules` only for float16 (T5's `wo` overflows there, not in bfloat16) and
    `_keep_in_fp32_modules_strict` for both; diffusers keeps `_keep_in_fp32_modules` for any lower dtype."""
    names = tuple(getattr(module, "_keep_in_fp32_modules", None) or ())
    if library != "transformers":
        return names
    strict = tuple(getattr(module, "_keep_in_fp32_modules_strict", None) or ())
    if dtype == torch.float16:
        return names + strict
    return strict if dtype == torch.bfloat16 else ()


def _packed_rule(config: ModelConfig, slot: str):
    """Which weights of a pre-quantised file stay packed: all (no option for this model), the 4-bit ones with a
    bitsandbytes method, the fp8 ones with torchao_fp8_w8a16, none with another method, `--fp8_models` or full
    training (`config.decode_prequantized`); never the layers the option keeps in full precision. None: decode all."""
    from .quant import _kept

    option = config.quant
    if config.wants_fp8(slot) or config.decode_prequantized:
        return None
    if option is None:
        return lambda name, weight: True
    kinds = ("nf4", "fp4") if option.method.startswith("bitsandbytes_") else \
        ("fp8",) if option.method == "torchao_fp8_w8a16" else ()
    if not kinds:
        return None
    return lambda name, weight: weight.kind in kinds and not _kept(name.removesuffix(".weight"), option.keep)


def load_component(config: ModelConfig | str | list[str], specs: Sequence[ComponentSpec] | None = None,
                   torch_dtype=torch.bfloat16, device: str | torch.device = "cpu",
                   detected: DetectedComponent | None = None, log=print) -> LoadedComponent:
    """Recognise (among `specs`, unless already `detected`), build and load one model: frozen (`requires_grad=False`), `eval()`, on `device`.

    Floating tensors are cast to `torch_dtype`; with `config.fp8` (or `--fp8_models <name>`) the Linear
    weights are stored in float8_e4m3fn as they are read (see `fp8.py`); with `config.quant` (--quant_options) in
    4 bits once loaded (see `quant.py`). Pre-quantised files (`prequant.py`) keep their packed weights where the
    run's options allow it and this machine runs them (see `_packed_rule`), else they are decoded to `torch_dtype`.
    """
    from .detect import read_header
    from .files import iter_tensors
    from .fp8 import enable_fp8_storage, fp8_weight_names
    from .prequant import QuantizedWeight, convert_packed, install_quantized, prequantized_layout, split_prequantized

    config = as_model_config(config)
    dtype = _dtype(torch_dtype)
    if detected is None and specs is None:
        raise TypeError("load_component needs the candidate specs (a family's components) or a detected component")
    det = detected or detect_component(config, specs)
    try:
        module = det.spec.build(det.config)
    except Exception as e:
        raise UserError(f"{det.source}: cannot build {det.spec.class_name} from this config "
                        f"({first_line(e)})") from e
    expected = {k: tuple(v.shape) for k, v in module.state_dict(keep_vars=True).items()}
    problem = _fit_errors(det, expected, _required(module))
    if problem:
        raise UserError(problem)
    fp8 = config.wants_fp8(det.name)
    if fp8 and config.quant is not None:  # enable_fp8_storage would leave quantize_linears no plain Linear
        raise UserError(f"--quant_options {config.describe()}:{config.quant.method} and --fp8_models {det.name} name "
                        f"the same model ({det.name}); choose one storage")
    fp8_names = set(fp8_weight_names(module)) if fp8 else set()
    keep_fp32 = _kept_in_fp32(module, det.spec.library, dtype)

    def cast(name, tensor):
        if tensor.is_floating_point():
            target = torch.float8_e4m3fn if name in fp8_names else \
                torch.float32 if any(m in name.split(".") for m in keep_fp32) else dtype
            tensor = tensor.to(target)
        return tensor.to(device)

    keep = _packed_rule(config, det.name)
    packed: dict[str, QuantizedWeight] = {}  # pre-quantised weights kept packed, installed once the rest is in

    def read(f):
        tensors = iter_tensors(f)
        if prequantized_layout(read_header(f)) is not None:
            plain, weights = split_prequantized(dict(tensors), f)
            tensors = [*plain.items(), *weights.items()]
        for key, tensor in tensors:
            yield det.spec.normalize_key(key), tensor

    def take(name, value):
        if not isinstance(value, QuantizedWeight):
            return cast(name, value)
        if keep is not None and keep(name, value):
            packed[name] = value
            return None
        return cast(name, value.dequantize(torch.float32))

    if det.spec.convert_state_dict is not None:
        # fused tensors are split across files' keys: convert the whole checkpoint at once
        state = {}
        for f in det.files:
            state.update(dict(read(f)))
        converted = convert_packed(det.spec.convert_state_dict, state, log)
        del state
        batch = {k: v for k, v in ((k, take(k, v)) for k, v in converted.items()) if v is not None}
        del converted
        module.load_state_dict(batch, strict=False, assign=True)
        del batch
    for f in det.files if det.spec.convert_state_dict is None else ():
        batch = {k: v for k, v in ((k, take(k, t)) for k, t in read(f)) if v is not None}
        module.load_state_dict(batch, strict=False, assign=True)
        del batch
    if packed:
        installed = install_quantized(module, packed, dtype, device, log=log)
        held = [kind for kind in installed.values() if kind != "decoded"]
        if held:
            log(f"{det.name}: {len(held)} weights of {_files_desc(det.files)} kept as stored "
                f"({', '.join(sorted(set(held)))})")
        del packed
    if hasattr(module, "tie_weights"):
        module.tie_weights()
    left = [n for n, t in list(module.named_parameters()) + list(module.named_buffers()) if t.is_meta]
    if left:
        raise UserError(f"{_files_desc(det.files)}: no weights for {len(left)} tensors of {det.spec.class_name} "
                        f"(e.g. {', '.join(left[:3])})")
    module.to(device)  # computed buffers
    if fp8:
        enable_fp8_storage(module, compute_dtype=dtype)
    if config.quant is not None:
        from .quant import quantize_linears

        quantize_linears(module, config.quant, compute_dtype=dtype, device=device)
    module.requires_grad_(False)
    module.eval()
    return LoadedComponent(det.name, module, det.files, det.source)


# -- tokenizer and processor ----------------------------------------------------------------------------

def model_directory(value: ModelConfig | str | os.PathLike, what: str) -> Path:
    """The folder a model flag names: a directory, the folder of a file (or of a file list's first file), or a
    ModelConfig's resolved place; a missing one is a UserError naming `what` (e.g. "tokenizer")."""
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
    path = model_directory(path_or_config, "tokenizer")
    if not any((path / n).is_file() for n in ("tokenizer.json", "tokenizer_config.json", "vocab.json")):
        raise UserError(f"{path}: no tokenizer here (expected tokenizer.json, tokenizer_config.json or vocab.json)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(path))
    except Exception as e:
        raise UserError(f"{path}: cannot load the tokenizer ({first_line(e)})") from e
