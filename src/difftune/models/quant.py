"""`--quant_options`: frozen Linear weights stored in 4 bits (bitsandbytes NF4 / FP4), for QLoRA.

The reference's syntax: entries separated by ";", each `<model entry>:<method>[/<layers kept in full precision>]`,
the model entry being one of --model_paths / --model_id_with_origin_paths (the last ":" ends it), the kept layers
comma-separated module names (a name matches itself or any module path ending in "." + name, e.g. `img_mod.1`).
Each quantised layer becomes bitsandbytes' `Linear4bit` (weight-only: it dequantises its weight in every forward and
passes gradients to its input), so peft puts a LoRA on it as on any Linear; the model itself stays frozen.

The torchao methods (`torchao_*_w*a16`: weight-only, activations in the compute dtype) swap each Linear's weight for a
torchao tensor (int8 / fp8 per row, int4 / nvfp4 in groups) that dequantises in the matmul and passes gradients to its
input; a method whose layers pass no gradient on this machine (missing kernels) is refused in one line after a probe.
Methods that quantise the activations too are refused by name (no gradient passes a quantised activation).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch
from torch import nn

from ..errors import UserError
from ..util import first_line
from ..util import names as split_names

METHODS = {"bitsandbytes_nf4": "nf4", "bitsandbytes_fp4": "fp4", "torchao_int8_w8a16": "int8",
           "torchao_fp8_w8a16": "fp8", "torchao_int4_w4a16": "int4", "torchao_nvfp4_w4a16": "nvfp4"}
INSTALL = "pip install 'difftune[quant]' (bitsandbytes)"
INSTALL_TORCHAO = "pip install 'difftune[torchao]'"
_ACTIVATIONS = "it quantises the activations too, and no gradient passes a quantised activation, so no LoRA trains " \
               "on it (the reference refuses it for training too); use its weight-only form"
# the reference's other methods: why each is refused
NOT_TRAINABLE = {
    "torchao_int8_w8a8": f"{_ACTIVATIONS} torchao_int8_w8a16", "torchao_fp8_w8a8": f"{_ACTIVATIONS} torchao_fp8_w8a16",
    "torchao_int4_w4a8": f"{_ACTIVATIONS} torchao_int4_w4a16", "torchao_mxfp8_w8a8": f"{_ACTIVATIONS} torchao_fp8_w8a16",
    "torchao_mxfp4_w4a4": f"{_ACTIVATIONS} torchao_nvfp4_w4a16",
    "torchao_nvfp4_w4a4": f"{_ACTIVATIONS} torchao_nvfp4_w4a16",
    "comfy_kitchen_int8_w8a8": "comfy-kitchen is not supported by difftune (its training kernels need CUDA 13); use "
                               "torchao_int8_w8a16",
    "comfy_kitchen_fp8_w8a8": "comfy-kitchen is not supported by difftune (its training kernels need CUDA 13); use "
                              "torchao_fp8_w8a16",
}


@dataclass(frozen=True)
class QuantOption:
    method: str  # a METHODS key
    keep: tuple[str, ...] = ()  # module names kept in full precision

    @property
    def quant_type(self) -> str:
        return METHODS[self.method]


def parse_quant_options(text: str | None) -> list[tuple[str, QuantOption]]:
    """(model entry, option) per `--quant_options` entry."""
    out = []
    for entry in (text or "").split(";"):
        entry = entry.strip()
        if not entry:
            continue
        model, sep, spec = entry.rpartition(":")
        if not sep or not model:
            raise UserError(f"--quant_options: {entry!r} is not <model entry>:<method>[/<layers kept in full "
                            f"precision>], e.g. owner/model:transformer/diffusion_pytorch_model*.safetensors:"
                            f"bitsandbytes_nf4/img_in,proj_out")
        method, _, keep = spec.partition("/")
        if method in NOT_TRAINABLE:
            raise UserError(f"--quant_options: {method} for {model}: {NOT_TRAINABLE[method]}")
        if method not in METHODS:
            raise UserError(f"--quant_options: unknown method {method!r} for {model} (known: {', '.join(METHODS)})")
        out.append((model, QuantOption(method, tuple(split_names(keep)))))
    return out


def apply_quant_options(configs: Sequence, text: str | None) -> None:
    """Set `config.quant` on the model configs the `--quant_options` entries name."""
    named: dict[int, tuple[str, QuantOption]] = {}  # config id -> (entry, option) already given to it
    for model, option in parse_quant_options(text):
        entry = model
        if model.startswith("["):  # a --model_paths entry that is a list of shards
            try:
                entry = json.loads(model)
            except json.JSONDecodeError:
                raise UserError(f"--quant_options: {model[:80]!r} is not a valid JSON list of shard paths") from None
        hits = [c for c in configs if c.matches(entry)]
        if not hits:
            raise UserError(f"--quant_options: {model!r} matches no entry of --model_paths or "
                            f"--model_id_with_origin_paths")
        for c in hits:
            if c.fp8:
                raise UserError(f"--quant_options: {model} is also in --fp8_models; choose one storage")
            if id(c) in named:  # the last would win silently
                first, before = named[id(c)]
                raise UserError(f"--quant_options: {c.describe()} is quantised twice ({first}:{before.method} and "
                                f"{model}:{option.method}); give one method per model")
            named[id(c)] = (model, option)
            c.quant = option


def bitsandbytes():
    """The bitsandbytes module, or a one-line error saying what to install / why it cannot run here."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        raise UserError(f"--quant_options needs bitsandbytes, which is not installed: {INSTALL}") from None
    except Exception as err:  # a broken native library
        raise UserError(f"--quant_options: bitsandbytes cannot be loaded here ({first_line(err)})") from None
    return bnb


def _kept(name: str, keep: Iterable[str]) -> bool:
    return any(name == k or name.endswith("." + k) for k in keep)


def torchao():
    """The torchao package, or a one-line error saying what to install."""
    try:
        import torchao as ao
    except ImportError:
        raise UserError(f"--quant_options: the torchao methods need torchao, which is not installed: "
                        f"{INSTALL_TORCHAO}") from None
    except Exception as err:
        raise UserError(f"--quant_options: torchao cannot be loaded here ({first_line(err)})") from None
    return ao


def torchao_config(method: str):
    """The torchao configuration of a weight-only method."""
    torchao()
    from torchao import quantization as q

    if method == "torchao_int8_w8a16":
        return q.Int8WeightOnlyConfig()
    if method == "torchao_fp8_w8a16":
        return q.Float8WeightOnlyConfig()
    if method == "torchao_int4_w4a16":
        return q.Int4WeightOnlyConfig(group_size=128)
    from torchao.prototype.mx_formats import NVFP4WeightOnlyConfig

    return NVFP4WeightOnlyConfig()


def _quantize_torchao(module: nn.Module, names: list[str], option: QuantOption, device) -> None:
    import warnings

    from torchao.quantization import quantize_

    chosen = set(names)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            quantize_(module, torchao_config(option.method), filter_fn=lambda m, fqn: fqn in chosen, device=device)
    except UserError:
        raise
    except Exception as err:
        raise UserError(f"--quant_options: {option.method} cannot quantise on {device} here ({first_line(err)})") \
            from None
    if names:  # a LoRA trains through the quantised layers only if they pass a gradient to their input here
        probe = module.get_submodule(names[0])
        weight = probe.weight
        x = torch.zeros(1, probe.in_features, dtype=weight.dtype, device=weight.device, requires_grad=True)
        try:
            probe(x).float().sum().backward()
        except Exception as err:
            raise UserError(f"--quant_options: {option.method}: its layers pass no gradient on {device} here "
                            f"({first_line(err)}), so no LoRA can train on them") from None
        if x.grad is None:
            raise UserError(f"--quant_options: {option.method}: its layers pass no gradient on {device} here, so no "
                            f"LoRA can train on them")


def quantize_linears(module: nn.Module, option: QuantOption, compute_dtype: torch.dtype,
                     device: str | torch.device = "cpu") -> list[str]:
    """Replace every nn.Linear of `module` (but the kept ones) with a 4-bit Linear4bit (bitsandbytes), or give it a
    torchao quantised weight, in place; the names quantised. Call it on a loaded, frozen model before a LoRA is
    injected."""
    unknown = [k for k in option.keep if not any(_kept(n, [k]) for n, _ in module.named_modules())]
    if unknown:
        raise UserError(f"--quant_options: layer(s) to keep in full precision {', '.join(unknown)} match no module of "
                        f"{type(module).__name__}")
    names = [n for n, m in module.named_modules()  # (a weight loaded packed from a pre-quantised file stays so)
             if n and type(m) is nn.Linear and type(m.weight) in (nn.Parameter, torch.Tensor)
             and not _kept(n, option.keep)]
    if option.method.startswith("torchao_"):
        torchao()
        module.requires_grad_(False)
        _quantize_torchao(module, names, option, device)
        return names
    bnb = bitsandbytes()
    from .bnb4bit import Linear4bit  # bitsandbytes' own, with its CPU kernel's shape limits checked

    for name in names:
        parent_name, _, leaf = name.rpartition(".")
        parent = module.get_submodule(parent_name) if parent_name else module
        linear = getattr(parent, leaf)
        with torch.device("meta"):  # no full-precision copy of the weight is allocated
            quant = Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                               compute_dtype=compute_dtype, quant_type=option.quant_type)
        quant.weight = bnb.nn.Params4bit(linear.weight.data.to(compute_dtype).contiguous(), requires_grad=False,
                                         quant_type=option.quant_type)
        if linear.bias is not None:
            quant.bias = nn.Parameter(linear.bias.data.to(compute_dtype), requires_grad=False)
        try:
            quant = quant.to(device)  # bitsandbytes quantises as the weight moves to its device
        except Exception as err:
            raise UserError(f"--quant_options: bitsandbytes cannot quantise on {device} here ({first_line(err)}); "
                            f"it needs a backend for this device (a CUDA GPU, or its CPU build)") from None
        setattr(parent, leaf, quant)
    return names


def _storage(method: str) -> str:
    kind = METHODS.get(method, "")
    return "4-bit" if kind in ("nf4", "fp4", "int4", "nvfp4") else kind or method


def check_quant_frozen(slots: Iterable[str] | dict, trainable: str | Iterable[str] | None) -> None:
    """Refuse quantised storage for a model that is trained in full (`--trainable_models`); LoRA on it is QLoRA.
    `slots`: the quantised models, or {slot: method} to name their storage."""
    methods = slots if isinstance(slots, dict) else {}
    both = sorted(set(split_names(list(slots))) & set(split_names(trainable)))
    if both:
        kinds = sorted({_storage(methods[s]) for s in both if s in methods}) or ["4-bit"]
        how = f" ({', '.join(sorted({methods[s] for s in both}))})" if methods else ""
        raise UserError(f"--quant_options: {', '.join(both)} is also in --trainable_models; {' / '.join(kinds)} "
                        f"weights{how} cannot be trained (train a LoRA on it with --lora_base_model instead)")
