"""Pre-quantised weight files: their Linear weights stored packed, with the tensors that decode them beside.

Layouts read (the keys named after a Linear's `P.weight`):
  - bitsandbytes 4-bit saves (`Linear4bit.state_dict()`, as diffusers / transformers / DiffSynth write them, and
    Ideogram-4's nf4 release): `P.weight` packed uint8, `P.weight.absmax`, `P.weight.quant_map`,
    `P.weight.quant_state.bitsandbytes__nf4` (or `__fp4`: a JSON of the shape, dtype and block size), and with
    double quantisation `P.weight.nested_absmax`, `P.weight.nested_quant_map`;
  - ComfyUI `fp8_scaled` files: `P.weight` in fp8, `P.scale_weight` (one scale, or one per row), optionally
    `P.scale_input`, and a `scaled_fp8` marker key;
  - fp8 with per-row scales (compressed-tensors' layout, Ideogram-4's fp8 release, BFL's fp8r, ComfyUI's
    `comfy_quant` float8 markers): `P.weight` in fp8, `P.weight_scale`, optionally `P.input_scale`.
The weight is `stored * scale` (per row) for the fp8 layouts, the 4-bit code looked up and scaled by its block's
absmax for bitsandbytes. Activation scales (`scale_input`, `input_scale`) are not used: a LoRA base computes in the
compute dtype. Any other quantised layout (bitsandbytes 8-bit, nvfp4, packed int4, torchao's own saves) is refused in
one line.

The generic entry points, usable on any state dict (a family's own loader calls them before converting keys):
  `split_prequantized(state)` -> (plain tensors, {weight key: QuantizedWeight}), keyed by the file's names;
  `unpack_state_dict(state, dtype, keep=False)` -> a normal state dict (weights decoded to `dtype`), or with
      keep=True {name: tensor | QuantizedWeight};
  `install_quantized(module, {name: QuantizedWeight}, ...)` puts weights into a model's Linear layers as bitsandbytes
      `Linear4bit` / torchao `Float8Tensor` weights (kept packed), or decoded.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from functools import lru_cache

import torch
from torch import nn

from ..errors import UserError
from ..util import first_line

BNB = "a bitsandbytes 4-bit save"
COMFY_FP8 = "a ComfyUI fp8_scaled checkpoint"
FP8 = "an fp8 checkpoint with weight scales"
_BNB_STATS = ("absmax", "quant_map", "nested_absmax", "nested_quant_map")
_BNB_STATE = ".quant_state.bitsandbytes__"
# layouts recognised as quantised but not read: key ending -> what it is
_UNSUPPORTED = {
    ".SCB": "a bitsandbytes 8-bit save (SCB tensors)",
    ".weight_format": "a bitsandbytes 8-bit save (weight_format tensors)",
    ".weight_scale_2": "an nvfp4 checkpoint (weight_scale_2 tensors)",
    ".weight_packed": "a compressed-tensors packed-int checkpoint (weight_packed tensors)",
    ".weight_zero_point": "a checkpoint with zero points (weight_zero_point tensors)",
    ":qdata": "a torchao tensor-subclass save (qdata tensors)",
}


def _role(key: str) -> tuple[str, str] | None:
    """(the weight's key, role) of a tensor that belongs to a quantised weight; None for an ordinary tensor."""
    if key == "scaled_fp8" or key.endswith(".scaled_fp8"):
        return "", "marker"
    if _BNB_STATE in key:
        return key.split(_BNB_STATE)[0], "bnb_state"
    dotted = "." + key  # a module's own tensors ("weight.absmax") end like a submodule's
    for stat in _BNB_STATS:
        if dotted.endswith(".weight." + stat):
            return key[:-len(stat) - 1], stat
    for suffix, role in ((".scale_weight", "scale"), (".weight_scale", "scale"), (".scale_input", "input_scale"),
                         (".input_scale", "input_scale"), (".comfy_quant", "comfy_quant")):
        if dotted.endswith(suffix):
            return (dotted[:-len(suffix)] + ".weight")[1:], role
    return None


def prequantized_layout(keys: Iterable[str]) -> str | None:
    """The quantised layout a checkpoint's tensor names show (BNB, FP8, another layout's description), or None for
    plain weights."""
    found = None
    for key in keys:
        for suffix, what in _UNSUPPORTED.items():
            if key.endswith(suffix):
                return what
        role = _role(key)
        if role is None:
            continue
        if role[1] in ("bnb_state",) + _BNB_STATS:
            found = BNB
        elif found != BNB and (role[1] == "marker" or key.endswith(".scale_weight")):
            found = COMFY_FP8
        elif found is None:
            found = FP8
    return found


def refusal(path: str, layout: str, why: str = "") -> UserError:
    return UserError(f"{path}: {layout}{': ' + why if why else ''}: difftune reads whole bitsandbytes 4-bit saves and "
                     f"fp8 files with weight scales only; give the full-precision weights and quantise them as they "
                     f"load with --quant_options <model entry>:<method> (e.g. bitsandbytes_nf4, torchao_fp8_w8a16)")


# -- one quantised weight ---------------------------------------------------------------------------------------------

@dataclass
class QuantizedWeight:
    """One Linear weight as a file stores it. `kind`: "nf4" / "fp4" (bitsandbytes) or "fp8" (fp8 values with one
    scale per output row; int8 values with scales decode the same way)."""

    kind: str
    shape: tuple[int, ...]  # the weight's own shape ([out, in])
    data: torch.Tensor  # packed 4-bit codes (uint8), or the fp8 values
    scale: torch.Tensor | None = None  # fp8: float32 [out]
    stats: dict = field(default_factory=dict)  # 4-bit: absmax, quant_map, blocksize, dtype (+ nested_*)
    source: str = ""  # the file's key, for messages

    def _absmax(self) -> torch.Tensor:
        s = self.stats
        if "nested_absmax" not in s:
            return s["absmax"].float()
        # double quantisation: the absmax are 8-bit codes of a second blockwise quantisation, plus an offset
        codes = s["nested_quant_map"].float()[s["absmax"].long()]
        n, block = codes.numel(), s["nested_blocksize"]
        scales = s["nested_absmax"].float().repeat_interleave(block)[:n]
        return codes * scales + float(s["nested_offset"])

    def dequantize(self, dtype: torch.dtype = torch.float32, native: bool = True) -> torch.Tensor:
        """The full-precision weight: through bitsandbytes' kernel where it is installed (`native`; ~17x faster on a
        CPU), else in plain torch (the same numbers)."""
        if self.kind == "fp8":
            return (self.data.float() * self.scale.float().reshape(-1, *[1] * (self.data.dim() - 1))).to(dtype)
        if native and self.data.device.type != "meta":
            try:
                import bitsandbytes  # noqa: F401
            except Exception:  # noqa: BLE001 - not installed or broken: plain torch below
                pass
            else:
                return self._bnb_dequantize(dtype)
        packed = self.data.reshape(-1).view(torch.uint8)
        code = self.stats["quant_map"].float()
        byte = torch.arange(256)
        pairs = torch.stack([code[byte >> 4], code[byte & 0x0F]], dim=-1)  # a byte's two values, high nibble first
        n = 1
        for d in self.shape:
            n *= d
        block = self.stats["blocksize"]
        absmax = self._absmax()
        values = pairs[packed.long()].reshape(-1)
        whole = absmax.numel() * block
        values = values[:whole] if values.numel() >= whole else \
            torch.nn.functional.pad(values, (0, whole - values.numel()))
        values = (values.view(-1, block) * absmax[:, None]).reshape(-1)[:n]
        return values.reshape(self.shape).to(dtype)

    def _bnb_dequantize(self, dtype: torch.dtype) -> torch.Tensor:
        import bitsandbytes as bnb

        params = self.params4bit(self.data.device, torch.float32)
        return bnb.functional.dequantize_4bit(params.data, params.quant_state).reshape(self.shape).to(dtype)

    def rows(self, start: int, stop: int) -> QuantizedWeight | None:
        """Output rows [start, stop) still packed (a fused qkv split into q, k, v); None when the cut is not on a
        block boundary of the 4-bit codes."""
        out = self.shape[0]
        per_row = 1
        for d in self.shape[1:]:
            per_row *= d
        shape = (stop - start, *self.shape[1:])
        if self.kind == "fp8":
            return replace(self, shape=shape, data=self.data[start:stop], scale=self.scale[start:stop])
        block = self.stats["blocksize"]
        if (start * per_row) % block or ((stop * per_row) % block and stop != out):
            return None
        flat = self.data.reshape(-1).view(torch.uint8)
        data = flat[start * per_row // 2:(stop * per_row + 1) // 2].reshape(-1, 1)
        absmax = self._absmax()[start * per_row // block:-(-stop * per_row // block)]
        stats = {k: v for k, v in self.stats.items() if not k.startswith("nested_")}
        stats["absmax"] = absmax
        return replace(self, shape=shape, data=data, stats=stats)

    def params4bit(self, device, dtype: torch.dtype):
        """A bitsandbytes `Params4bit` holding this weight (as `Linear4bit.weight`)."""
        import bitsandbytes as bnb

        stats = {k: v for k, v in self.stats.items() if k != "dtype"}
        stats.update(quant_type=self.kind, shape=list(self.shape),
                     dtype=str(dtype).removeprefix("torch."))  # the dtype it dequantises to: the compute dtype
        stats["quant_map"] = stats["quant_map"].float()
        return bnb.nn.Params4bit.from_prequantized(self.data.view(torch.uint8).reshape(-1, 1), stats,
                                                   requires_grad=False, device=device)

    def float8_tensor(self, dtype: torch.dtype, device):
        """A torchao `Float8Tensor` (per-row scales) computing in `dtype`, as torchao_fp8_w8a16 makes."""
        from torchao.quantization import Float8Tensor

        data = self.data if self.data.dtype == torch.float8_e4m3fn else self.dequantize(torch.float32)
        if data.dtype != torch.float8_e4m3fn:  # e5m2 / int8 values: requantise per row
            amax = data.abs().amax(dim=1).clamp(min=1e-12)
            scale = amax / torch.finfo(torch.float8_e4m3fn).max
            data = (data / scale[:, None]).to(torch.float8_e4m3fn)
        else:
            scale = self.scale.float()
        return Float8Tensor(data.to(device), scale.reshape(-1, 1).to(device), block_size=[1, self.shape[1]],
                            dtype=dtype)


# -- a state dict -----------------------------------------------------------------------------------------------------

def _json_tensor(tensor: torch.Tensor, what: str) -> dict:
    try:
        value = json.loads(bytes(tensor.reshape(-1).to(torch.uint8).tolist()).decode())
    except (ValueError, UnicodeDecodeError) as err:
        raise ValueError(f"{what} is not a JSON record ({first_line(err)})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{what} is not a JSON object")
    return value


# bitsandbytes' 4-bit code tables (get_4bit_type): its kernels use these whatever a file's quant_map says, so a map
# that is not its type's table would decode differently here (plain torch) and there
_CODES = {
    "nf4": (-1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453, -0.28444138169288635,
            -0.18477343022823334, -0.09105003625154495, 0.0, 0.07958029955625534, 0.16093020141124725,
            0.24611230194568634, 0.33791524171829224, 0.44070982933044434, 0.5626170039176941, 0.7229568362236023,
            1.0),
    "fp4": (0.0, 0.0052083334885537624, 0.6666666865348816, 1.0, 0.3333333432674408, 0.5, 0.1666666716337204, 0.25,
            0.0, -0.0052083334885537624, -0.6666666865348816, -1.0, -0.3333333432674408, -0.5, -0.1666666716337204,
            -0.25),
}
_BLOCKSIZES = (32, 64, 128, 256, 512, 1024, 2048, 4096)
_DTYPES = ("float32", "float16", "bfloat16")


def _finite(tensor: torch.Tensor) -> bool:
    """Whether every value is finite (a header-only stand-in on the meta device has none to check)."""
    return tensor.is_meta or bool(torch.isfinite(tensor.float()).all())


def _blocksize(key: str, meta: dict, name: str) -> int:
    value = meta.get(name)
    if isinstance(value, bool) or not isinstance(value, int) or value not in _BLOCKSIZES:
        raise ValueError(f"{key}: its quant_state says {name} {value!r} (bitsandbytes uses "
                         f"{', '.join(map(str, _BLOCKSIZES))})")
    return value


def _check_bnb(key: str, kind: str, data: torch.Tensor, shape: tuple[int, ...], parts: dict, meta: dict,
               nested: bool) -> None:
    """Every field of a 4-bit quant state against the packed weight, before any kernel reads it: a short absmax or a
    weight of the wrong size would have bitsandbytes read past the end of its memory (a segfault)."""
    n = 1
    for d in shape:
        n *= d
    need = (n + 1) // 2  # two 4-bit codes a byte
    have = data.numel() * data.element_size()
    packed = data.dtype in (torch.uint8, torch.int8) or (data.is_floating_point() and data.dim() == 2
                                                         and data.shape[1] == 1)  # bitsandbytes' quant_storage
    if not packed or have != need:
        raise ValueError(f"{key} is {str(data.dtype).removeprefix('torch.')} {list(data.shape)} ({have} bytes), not "
                         f"the packed 4-bit codes its quant_state describes ({need} bytes of uint8 for {list(shape)})")
    blocksize = _blocksize(key, meta, "blocksize")
    if meta.get("dtype", "float32") not in _DTYPES:
        raise ValueError(f"{key}: its quant_state says dtype {meta.get('dtype')!r} (expected one of "
                         f"{', '.join(_DTYPES)})")
    absmax, code = parts["absmax"], parts["quant_map"]
    blocks = -(-n // blocksize)
    if absmax.numel() != blocks:
        raise ValueError(f"{key}.absmax has {absmax.numel()} values for the {blocks} blocks of {blocksize} of "
                         f"{list(shape)}")
    if code.numel() != 16 or not code.is_floating_point():
        raise ValueError(f"{key}.quant_map is {str(code.dtype).removeprefix('torch.')} {list(code.shape)}, not the 16 "
                         f"values of a 4-bit code")
    if nested:
        if absmax.dtype != torch.uint8:
            raise ValueError(f"{key}.absmax is {str(absmax.dtype).removeprefix('torch.')}, not the 8-bit codes of a "
                             f"double-quantised save (it has nested_absmax)")
        nested_block = _blocksize(key, meta, "nested_blocksize")
        inner, inner_code = parts["nested_absmax"], parts["nested_quant_map"]
        if inner.numel() != -(-blocks // nested_block):
            raise ValueError(f"{key}.nested_absmax has {inner.numel()} values for the {-(-blocks // nested_block)} "
                             f"blocks of {nested_block} of its {blocks} absmax")
        if inner_code.numel() != 256 or not inner_code.is_floating_point():
            raise ValueError(f"{key}.nested_quant_map is {str(inner_code.dtype).removeprefix('torch.')} "
                             f"{list(inner_code.shape)}, not the 256 values of an 8-bit code")
        if meta.get("nested_dtype", "float32") not in _DTYPES:
            raise ValueError(f"{key}: its quant_state says nested_dtype {meta.get('nested_dtype')!r}")
        offset = meta.get("nested_offset")
        if isinstance(offset, bool) or not isinstance(offset, (int, float)) or not math.isfinite(offset):
            raise ValueError(f"{key}: its quant_state says nested_offset {offset!r}, not a finite number")
        for name, tensor in (("nested_absmax", inner), ("nested_quant_map", inner_code)):
            if not _finite(tensor):
                raise ValueError(f"{key}.{name} holds non-finite values (NaN or inf)")
    elif not absmax.is_floating_point():
        raise ValueError(f"{key}.absmax is {str(absmax.dtype).removeprefix('torch.')}, not floating point (and there "
                         f"is no nested_absmax to decode it)")
    elif not _finite(absmax):
        raise ValueError(f"{key}.absmax holds non-finite values (NaN or inf)")
    elif not absmax.is_meta and bool((absmax < 0).any()):
        raise ValueError(f"{key}.absmax holds negative values (a block's largest magnitude)")
    if not code.is_meta:
        if not _finite(code):
            raise ValueError(f"{key}.quant_map holds non-finite values (NaN or inf)")
        other = "fp4" if kind == "nf4" else "nf4"
        if not torch.allclose(code.float(), torch.tensor(_CODES[kind]), atol=1e-4):
            said = f"{other}'s" if torch.allclose(code.float(), torch.tensor(_CODES[other]), atol=1e-4) else \
                "neither nf4's nor fp4's"
            raise ValueError(f"{key}: a mismatch: its quant_state says {kind} but its quant_map is {said} code table")


def _bnb_weight(key: str, data: torch.Tensor, parts: dict[str, torch.Tensor]) -> QuantizedWeight:
    states = [k for k in parts if k.startswith("bnb_state:")]
    if len(states) != 1:
        raise ValueError(f"{key} has {len(states)} quant_state records (expected one quant_state.bitsandbytes__nf4 "
                         f"or __fp4)")
    kind = states[0].split("bitsandbytes__")[-1]
    meta = _json_tensor(parts[states[0]], f"{key}.quant_state")
    if kind not in ("nf4", "fp4"):
        raise ValueError(f"{key}: unknown 4-bit type {kind!r}")
    if meta.get("quant_type", kind) != kind:
        raise ValueError(f"{key}: a mismatch: its record is quant_state.bitsandbytes__{kind} but says quant_type "
                         f"{meta.get('quant_type')!r}")
    missing = [s for s in ("absmax", "quant_map") if s not in parts]
    nested = "nested_absmax" in parts or "nested_blocksize" in meta
    missing += [s for s in ("nested_absmax", "nested_quant_map") if nested and s not in parts]
    if missing or not isinstance(meta.get("shape"), list) or "blocksize" not in meta:
        raise ValueError(f"{key} lacks {', '.join(missing) or 'its shape and block size'}")
    if not meta["shape"] or not all(isinstance(d, int) and not isinstance(d, bool) and d > 0 for d in meta["shape"]):
        raise ValueError(f"{key}: its quant_state says shape {meta['shape']!r}, not a list of sizes")
    shape = tuple(meta["shape"])
    _check_bnb(key, kind, data, shape, parts, meta, nested)
    stats = {"absmax": parts["absmax"], "quant_map": parts["quant_map"], "blocksize": int(meta["blocksize"]),
             "dtype": meta.get("dtype", "float32")}
    if nested:
        stats.update(nested_absmax=parts["nested_absmax"], nested_quant_map=parts["nested_quant_map"],
                     nested_blocksize=int(meta["nested_blocksize"]), nested_dtype=meta.get("nested_dtype", "float32"),
                     nested_offset=float(meta["nested_offset"]))
    return QuantizedWeight(kind, shape, data, stats=stats, source=key)


def _fp8_weight(key: str, data: torch.Tensor, parts: dict[str, torch.Tensor], scale_key: str) -> QuantizedWeight:
    if "comfy_quant" in parts:
        fmt = _json_tensor(parts["comfy_quant"], f"{key[:-len('.weight')]}.comfy_quant").get("format")
        if fmt not in ("float8_e4m3fn", "float8_e5m2"):
            raise LookupError(f"a ComfyUI comfy_quant checkpoint in the {fmt} format")
    if "scale" not in parts:
        raise ValueError(f"{key} has no scale")
    if data.dim() != 2:
        raise ValueError(f"{key} is {list(data.shape)}, not a Linear weight")
    if not _finite(parts["scale"]):
        raise ValueError(f"{scale_key} holds non-finite values (NaN or inf)")
    scale = parts["scale"].float().reshape(-1)
    if not scale.is_meta and (bool((scale < 0).any()) or not bool((scale != 0).any())):
        # a scale is the weight's largest magnitude over the fp8 range: negative flips the weight, all 0 erases it
        raise ValueError(f"{scale_key} holds {'negative values' if bool((scale < 0).any()) else 'only zeros'} "
                         f"(a scale is positive)")
    if scale.numel() == 1:
        scale = scale.expand(data.shape[0]).contiguous()
    elif scale.numel() != data.shape[0]:
        raise ValueError(f"{key}'s scale has {scale.numel()} values for {data.shape[0]} rows (block scales are not "
                         f"read)")
    return QuantizedWeight("fp8", tuple(data.shape), data, scale=scale, source=key)


def split_prequantized(state: Mapping[str, torch.Tensor], path: str = "state dict"
                       ) -> tuple[dict[str, torch.Tensor], dict[str, QuantizedWeight]]:
    """(plain tensors, {weight key: QuantizedWeight}) of a pre-quantised state dict, keyed by its own names; a broken
    or unsupported layout is a one-line UserError naming `path`."""
    layout = prequantized_layout(state)
    if layout not in (None, BNB, COMFY_FP8, FP8):
        raise refusal(path, layout)
    plain, parts, scale_keys = {}, {}, {}
    for key, tensor in state.items():
        role = _role(key)
        if role is None:
            plain[key] = tensor
        elif role[1] != "marker":
            name = f"bnb_state:{key}" if role[1] == "bnb_state" else role[1]
            parts.setdefault(role[0], {})[name] = tensor
            if role[1] == "scale":
                scale_keys[role[0]] = key
    weights = {}
    for key, pieces in parts.items():
        if key not in plain:
            raise refusal(path, layout, f"{key} is missing beside its {', '.join(sorted(pieces))}")
        data = plain[key]
        try:
            if any(p.startswith("bnb_state:") or p in _BNB_STATS for p in pieces):
                weights[key] = _bnb_weight(key, data, pieces)
            elif "scale" in pieces or "comfy_quant" in pieces:
                weights[key] = _fp8_weight(key, data, pieces, scale_keys.get(key, ""))
            else:
                continue  # only an activation scale: the weight is a plain tensor
        except LookupError as err:
            raise refusal(path, str(err)) from None
        except ValueError as err:
            raise refusal(path, layout, str(err)) from None
        del plain[key]
    if layout in (COMFY_FP8, FP8) and _scaled_fp8(state):
        bare = [k for k, t in plain.items() if t.dtype in _FP8_DTYPES and t.numel()]
        if bare:
            raise refusal(path, layout, f"{bare[0]} is fp8 without its weight_scale / scale_weight "
                                        f"({len(bare)} such weight(s)), so it would be used unscaled")
    return plain, weights


_FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)


def _scaled_fp8(keys: Iterable[str]) -> bool:
    """Whether a file is "fp8 scaled", so that every fp8 tensor in it needs its scale: it has ComfyUI's `scaled_fp8`
    marker, or a weight scale (`scale_weight` / `weight_scale`) beside some weight. A file of fp8 tensors with no
    scale at all is plain fp8 by design (its values are the weights) and loads as such."""
    return any(role is not None and role[1] in ("marker", "scale") for role in map(_role, keys))


def unpack_state_dict(state: Mapping[str, torch.Tensor], dtype: torch.dtype = torch.bfloat16, keep: bool = False,
                      path: str = "state dict") -> dict[str, torch.Tensor | QuantizedWeight]:
    """A pre-quantised state dict as a normal one keyed by the same names (the weights decoded to `dtype`), or with
    `keep` {name: plain tensor | QuantizedWeight} for `install_quantized`."""
    plain, weights = split_prequantized(state, path)
    out: dict = dict(plain)
    for key, weight in weights.items():
        out[key] = weight if keep else weight.dequantize(dtype)
    return out


# -- headers (recognition) --------------------------------------------------------------------------------------------

@lru_cache(maxsize=64)
def _logical_shapes(path: str, stamp: tuple) -> tuple[tuple[str, tuple[int, ...]], ...]:
    from safetensors import safe_open

    from .files import is_state_dict_pickle, load_pth

    if is_state_dict_pickle(path):
        state = load_pth(path)
    else:
        state = {}
        with safe_open(path, framework="pt", device="cpu") as f:
            for key in f.keys():
                role = _role(key)
                # only the JSON records that say what a weight is are read (a few hundred bytes each); the weights
                # and their scales stay on disk
                state[key] = f.get_tensor(key) if role is not None and role[1] in ("bnb_state", "comfy_quant") else \
                    torch.empty(f.get_slice(key).get_shape(), dtype=_dtype_of(f.get_slice(key).get_dtype()),
                                device="meta")
    plain, weights = split_prequantized(state, path)
    shapes = {k: tuple(v.shape) for k, v in plain.items()}
    shapes.update({k: w.shape for k, w in weights.items()})
    return tuple(shapes.items())


def _dtype_of(name: str) -> torch.dtype:
    return {"F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2, "U8": torch.uint8, "I8": torch.int8,
            "BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}.get(name, torch.float32)


def logical_shapes(path: str, shapes: dict[str, tuple[int, ...]]) -> dict[str, tuple[int, ...]]:
    """{key: shape} of a weight file as the model sees it: the decoding tensors dropped and each packed weight at its
    own shape (from its quant state). Plain files pass through unchanged."""
    if prequantized_layout(shapes) is None:
        return shapes
    st = os.stat(path)
    return dict(_logical_shapes(path, (st.st_size, st.st_mtime_ns)))


# -- into a model -----------------------------------------------------------------------------------------------------

def _probe(layer: nn.Module, dtype: torch.dtype) -> str | None:
    """Why a gradient does not pass this layer to its input here (None: it does, so a LoRA can train on top)."""
    weight = layer.weight
    x = torch.zeros(1, layer.in_features, dtype=dtype, device=weight.device, requires_grad=True)
    try:
        layer(x).float().sum().backward()
    except Exception as err:  # noqa: BLE001 - a missing kernel shows here in many forms
        return first_line(err)
    return None if x.grad is not None else "no gradient reached the input"


def _decoded(linear: nn.Module, weight: QuantizedWeight, dtype, device) -> nn.Module:
    linear.weight = nn.Parameter(weight.dequantize(dtype).to(device), requires_grad=False)
    return linear


def install_quantized(module: nn.Module, weights: Mapping[str, QuantizedWeight], compute_dtype: torch.dtype,
                      device: str | torch.device = "cpu",
                      keep: Callable[[str, QuantizedWeight], bool] = lambda n, w: True,
                      log: Callable[[str], None] = print) -> dict[str, str]:
    """Put each weight of {state-dict key: QuantizedWeight} into `module`: kept packed where `keep(key, weight)` says
    so and this machine runs it (4-bit: the Linear becomes a bitsandbytes `Linear4bit`; fp8: its weight a torchao
    `Float8Tensor`; one layer of each is probed for a gradient to its input), decoded to `compute_dtype` otherwise,
    with one note per reason. A weight whose module is not an nn.Linear is decoded. Returns {key: "nf4" / "fp4" /
    "fp8" / "decoded"}."""
    out, why = {}, {}
    kept: dict[str, list[str]] = {}
    for key, weight in weights.items():
        owner_name = key.removesuffix(".weight")
        try:
            owner = module.get_submodule(owner_name) if key.endswith(".weight") else None
        except AttributeError:
            owner = None
        if owner is None or tuple(getattr(owner, "weight", torch.empty(0)).shape) != weight.shape:
            raise UserError(f"{weight.source or key}: a quantised weight of shape {list(weight.shape)} that no layer "
                            f"of {type(module).__name__} takes")
        family = "fp8" if weight.kind == "fp8" else "4bit"
        # a subclass may compute with its weight in its own way: only plain Linear layers hold packed weights
        reason = None if keep(key, weight) and type(owner) is nn.Linear else "asked"
        if reason is None:
            reason = _backend_missing(family)
        if reason is None:
            try:
                _install(module, owner_name, owner, weight, compute_dtype, device)
                kept.setdefault(family, []).append(key)
                out[key] = weight.kind
                continue
            except Exception as err:  # noqa: BLE001
                reason = f"it cannot hold them here ({first_line(err)})"
        if reason != "asked":
            why.setdefault(family, reason)
        _decoded(owner, weight, compute_dtype, device)
        out[key] = "decoded"
    for family, keys in list(kept.items()):
        layer = module.get_submodule(keys[0].removesuffix(".weight"))
        problem = _probe(layer, compute_dtype)
        if problem is not None:
            why.setdefault(family, f"its layers pass no gradient here ({problem})")
            for key in keys:
                _replace_decoded(module, key.removesuffix(".weight"), weights[key], compute_dtype, device)
                out[key] = "decoded"
    for family, reason in why.items():
        n = sum(1 for k, v in out.items()
                if v == "decoded" and ("fp8" if weights[k].kind == "fp8" else "4bit") == family)
        log(f"note: {n} pre-quantised {'fp8' if family == 'fp8' else '4-bit'} weights of {type(module).__name__} "
            f"decoded to {str(compute_dtype).removeprefix('torch.')}: {reason}")
    return out


def _replace_decoded(module: nn.Module, name: str, weight: QuantizedWeight, dtype, device) -> None:
    """The packed layer `name` replaced by a plain Linear holding the decoded weight (and the layer's bias)."""
    old = module.get_submodule(name)
    linear = nn.Linear(weight.shape[1], weight.shape[0], bias=old.bias is not None, device="meta")
    if old.bias is not None:
        linear.bias = old.bias
    parent, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(parent) if parent else module, leaf, _decoded(linear, weight, dtype, device))


def _backend_missing(family: str) -> str | None:
    try:
        if family == "fp8":
            import torchao  # noqa: F401
            from torchao.quantization import Float8Tensor  # noqa: F401
        else:
            import bitsandbytes  # noqa: F401
    except ImportError:
        return f"{'torchao' if family == 'fp8' else 'bitsandbytes'} is not installed"
    except Exception as err:  # noqa: BLE001 - a broken native library
        return f"{'torchao' if family == 'fp8' else 'bitsandbytes'} cannot be loaded here ({first_line(err)})"
    return None


def _install(module: nn.Module, name: str, linear: nn.Linear, weight: QuantizedWeight, dtype, device) -> None:
    if weight.kind == "fp8":
        import warnings

        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            linear.weight = nn.Parameter(weight.float8_tensor(dtype, device), requires_grad=False)
        return
    from .bnb4bit import Linear4bit  # bitsandbytes' own, with its CPU kernel's shape limits checked

    with torch.device("meta"):
        quant = Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                           compute_dtype=dtype, quant_type=weight.kind,
                           compress_statistics="nested_absmax" in weight.stats)
    quant.weight = weight.params4bit(device, dtype)
    quant.weight.module = quant
    quant.quant_state = quant.weight.quant_state
    if linear.bias is not None:
        quant.bias = linear.bias
    parent, _, leaf = name.rpartition(".")
    setattr(module.get_submodule(parent) if parent else module, leaf, quant)


def _row_range(view: torch.Tensor, base: torch.Tensor) -> tuple[int, int] | None:
    """The output rows of `base` that `view` is (a torch.split / chunk / narrow along dim 0), else None."""
    if view.shape[1:] != base.shape[1:] or view.stride() != base.stride():
        return None
    per_row = base.stride(0) if base.dim() else 1
    if view.storage_offset() % per_row:
        return None
    start = view.storage_offset() // per_row
    return start, start + view.shape[0]


def _convert_stand_ins(convert, state: dict) -> tuple[dict, set[str]]:
    """One run of `convert` with each QuantizedWeight of `state` as an empty stand-in: (its output with the weights
    that came out renamed or cut into rows packed again, the input keys of those that did not)."""
    stand_ins, feed = {}, {}
    for key, value in state.items():
        if isinstance(value, QuantizedWeight):
            proxy = torch.empty(value.shape, device="meta")
            stand_ins[id(proxy)] = (proxy, key)
            feed[key] = proxy
        else:
            feed[key] = value
    out, failed, used = {}, False, set()
    for key, value in convert(feed).items():
        if not (torch.is_tensor(value) and value.is_meta):
            out[key] = value
            continue
        base = value if id(value) in stand_ins else value._base
        found = stand_ins.get(id(base)) if base is not None else None
        rows = None
        if found is not None and found[0] is base:
            rows = (0, value.shape[0]) if value is base else _row_range(value, base)
        part = None if rows is None else state[found[1]] if value is base else state[found[1]].rows(*rows)
        if part is None:
            failed = True
            continue
        out[key] = part
        used.add(found[1])
    return out, (set() if not failed else {k for _, k in stand_ins.values()} - used)


def convert_packed(convert: Callable[[dict], dict], state: dict, log: Callable[[str], None] = print) -> dict:
    """`convert(state)` (a key-layout converter written for plain tensors) on a state dict holding QuantizedWeights:
    each goes in as an empty (meta) stand-in of its shape; a stand-in that comes out renamed, or cut into row ranges
    (a fused qkv split), comes out packed. The weights the converter does anything else with (concatenates,
    transposes, computes) are decoded and it runs again; if it still needs more, every weight is decoded."""
    if not any(isinstance(v, QuantizedWeight) for v in state.values()):
        return convert(state)
    out, needed = _convert_stand_ins(convert, state)
    if not needed:
        return out
    decoded = {k: v.dequantize(torch.float32) if k in needed else v for k, v in state.items()}
    try:
        out, more = _convert_stand_ins(convert, decoded)
    except (RuntimeError, ValueError, KeyError, IndexError):  # e.g. a decoded weight concatenated with a stand-in
        more = needed
    if not more:
        log(f"note: {len(needed)} pre-quantised weights decoded: converting the layout needs them in full "
            f"(e.g. {sorted(needed)[0]})")
        return out
    log("note: the pre-quantised weights are decoded: converting the layout needs them in full")
    return convert({k: v.dequantize(torch.float32) if isinstance(v, QuantizedWeight) else v for k, v in state.items()})
