"""How a stage-1 value is kept in the cache, every kind in one place.

A sample's values (what stage 1 hands to stage 2) are turned into what the store holds, and back:

* a tensor: a CPU tensor in the safetensors shard;
* an image (PIL) or a list of images: uint8 tensors (H, W, C; C = 4 when an image has alpha) plus a marker value
  `<name>__difftune_images__` saying whether it was one image or a list (stage 2 gets PIL images back);
* a list (of tensors, numbers, strings, lists): kept as a list; JSON values (str, int, float, bool) as JSON;
* None: a JSON null.

The store (`store.py`) then encodes each value as {"json"} | {"tensor"} | {"list"} | {"dict"} in the shard's
index (`encode_value` / `decode_value` below); nothing is ever pickled.
"""

from __future__ import annotations

import copy
import hashlib
import math
from typing import Any, Callable

import numpy as np
import torch
from PIL import Image

IMAGE_MARK = "__difftune_images__"
DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
    torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)}


# -- sample values <-> what the store takes --------------------------------------------------------------------------

def images_to_cache(value):
    """PIL image(s) marked as images: one image -> a uint8 tensor (1, H, W, C); a list -> one uint8 tensor
    (H, W, C) per image (the images of one list may differ in size, e.g. Edit-Plus's edit images). C is 4 when an
    image has alpha (Qwen-Image-Layered's RGBA layers keep it), else 3. Anything else unchanged."""
    if isinstance(value, Image.Image):
        mode = "RGBA" if value.mode == "RGBA" else "RGB"
        return {IMAGE_MARK: torch.from_numpy(np.stack([np.asarray(value.convert(mode))])), "single": True}
    if isinstance(value, list) and value and all(isinstance(v, Image.Image) for v in value):
        mode = "RGBA" if any(i.mode == "RGBA" for i in value) else "RGB"
        return {IMAGE_MARK: [torch.from_numpy(np.array(i.convert(mode))) for i in value], "single": False}
    return value


def images_from_cache(value):
    if isinstance(value, dict) and IMAGE_MARK in value:
        images = [Image.fromarray(a.numpy()) for a in value[IMAGE_MARK]]  # a stacked tensor or a list of them
        return images[0] if value.get("single") else images
    return value


def to_cache(values: dict[str, Any]) -> dict[str, Any]:
    """One sample's stage-1 values -> what the store accepts: tensors (CPU) and JSON values; images as uint8
    tensors with their marker."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        value = images_to_cache(value)
        if isinstance(value, dict) and IMAGE_MARK in value:
            out[key] = value[IMAGE_MARK]
            out[f"{key}{IMAGE_MARK}"] = bool(value["single"])
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().to("cpu").contiguous()
        else:
            out[key] = value
    return out


def from_cache(sample: dict[str, Any]) -> dict[str, Any]:
    """A sample as the store returns it -> its values again (images as PIL); bookkeeping keys (`_id`) dropped."""
    out = {}
    for key, value in sample.items():
        if key.endswith(IMAGE_MARK) or key.startswith("_"):
            continue
        flag = sample.get(f"{key}{IMAGE_MARK}")
        out[key] = images_from_cache({IMAGE_MARK: value, "single": flag}) if flag is not None else value
    return out


# -- a value <-> its encoding in a shard's index ---------------------------------------------------------------------
# {"json": v} | {"tensor": ref} | {"list": [enc...]} | {"dict": {k: enc}}; lists and dicts with no tensor inside
# collapse to {"json": ...}. The tags make the encoding unambiguous, whatever keys the user's dicts hold.

def _tensor_bytes(t: torch.Tensor):
    return t.reshape(-1).view(torch.uint8).numpy().data


def tensor_sha256(t: torch.Tensor) -> str:
    return hashlib.sha256(_tensor_bytes(t)).hexdigest()


class Encoder:
    """Encodes one sample's values; the tensors it meets are collected in `tensors` (key -> tensor)."""

    def __init__(self, sample_id: str, tensors: dict[str, torch.Tensor]):
        self.sample_id, self.tensors, self.nbytes = sample_id, tensors, 0

    def encode(self, value: Any, where: str) -> dict:
        if value is None or isinstance(value, (str, bool, int)):
            return {"json": value}
        if isinstance(value, float):
            if not math.isfinite(value):
                raise ValueError(f"cache value {where!r} of sample {self.sample_id!r} is {value}; JSON cannot "
                                 "hold NaN/Inf (store it as a tensor if that is intended)")
            return {"json": value}
        if isinstance(value, torch.Tensor):
            return {"tensor": self._tensor(value, where)}
        if isinstance(value, (list, tuple)):
            items = [self.encode(v, f"{where}[{i}]") for i, v in enumerate(value)]
            if all("json" in e for e in items):
                return {"json": [e["json"] for e in items]}
            return {"list": items}
        if isinstance(value, dict):
            bad = [k for k in value if not isinstance(k, str)]
            if bad:
                raise TypeError(f"cache value {where!r} of sample {self.sample_id!r} has a non-string dict key "
                                f"{bad[0]!r}; JSON keys must be strings")
            items = {k: self.encode(v, f"{where}.{k}") for k, v in value.items()}
            if all("json" in e for e in items.values()):
                return {"json": {k: e["json"] for k, e in items.items()}}
            return {"dict": items}
        kind = f"{type(value).__module__}.{type(value).__qualname__}"
        raise TypeError(f"cache value {where!r} of sample {self.sample_id!r} is a {kind}; the cache stores "
                        "tensors and JSON values (str, int, float, bool, None, list, dict) only — convert it "
                        "first (e.g. an image to a uint8 tensor)")

    def _tensor(self, t: torch.Tensor, where: str) -> dict:
        dtype = str(t.dtype).removeprefix("torch.")
        if dtype not in DTYPES:
            raise TypeError(f"cache value {where!r} of sample {self.sample_id!r} has dtype {dtype}; "
                            f"supported: {', '.join(DTYPES)}")
        if t.layout != torch.strided or t.is_meta:
            raise TypeError(f"cache value {where!r} of sample {self.sample_id!r} is a {t.layout} / meta "
                            "tensor; store dense tensors with data")
        # A fresh contiguous CPU copy: never a view that pins a whole batch or shares storage with another.
        t = t.detach().to("cpu", copy=True).contiguous()
        key = f"{self.sample_id}/{where.replace('[', '/').replace(']', '').replace('.', '/')}"
        while key in self.tensors:  # only a pathological id/name combination can collide
            key += "#"
        self.tensors[key] = t
        self.nbytes += t.numel() * t.element_size()
        return {"key": key, "dtype": dtype, "shape": list(t.shape), "sha256": tensor_sha256(t)}


def decode_value(enc: dict, get_tensor: Callable[[str], torch.Tensor]) -> Any:
    if "json" in enc:
        value = enc["json"]
        return copy.deepcopy(value) if isinstance(value, (list, dict)) else value
    if "tensor" in enc:
        return get_tensor(enc["tensor"]["key"])
    if "list" in enc:
        return [decode_value(e, get_tensor) for e in enc["list"]]
    if "dict" in enc:
        return {k: decode_value(e, get_tensor) for k, e in enc["dict"].items()}
    raise ValueError(f"unknown value encoding {sorted(enc)}")


def spec_of(enc: dict) -> dict | None:
    """The frontier spec of an encoded top-level value; None for a None value (fits any spec)."""
    if "tensor" in enc:
        return {"kind": "tensor", "dtype": enc["tensor"]["dtype"]}
    if "json" in enc:
        return None if enc["json"] is None else {"kind": "json"}
    return {"kind": "tree"}


def tensor_refs(enc: dict, path: str):
    """(path, tensor ref) for every tensor inside an encoded value."""
    if "tensor" in enc:
        yield path, enc["tensor"]
    elif "list" in enc:
        for i, e in enumerate(enc["list"]):
            yield from tensor_refs(e, f"{path}[{i}]")
    elif "dict" in enc:
        for k, e in enc["dict"].items():
            yield from tensor_refs(e, f"{path}.{k}")


def content_of(enc: Any) -> Any:
    """An encoded value without its storage keys: equal content <=> equal result of this."""
    if isinstance(enc, dict):
        if "tensor" in enc:
            return {"tensor": {k: v for k, v in enc["tensor"].items() if k != "key"}}
        return {k: content_of(v) for k, v in enc.items()}
    if isinstance(enc, list):
        return [content_of(v) for v in enc]
    return enc


def merge_spec(frontier: dict[str, dict | None], name: str, spec: dict | None) -> str | None:
    """Record `spec` for `name` in `frontier`; return a description of the conflict, if any."""
    have = frontier.get(name)
    if spec is None:
        return None
    if have is None:
        frontier[name] = spec
        return None
    if have != spec:
        return f"{name!r} is {_describe(spec)} but earlier samples have {_describe(have)}"
    return None


def _describe(spec: dict) -> str:
    if spec["kind"] == "tensor":
        return f"a {spec['dtype']} tensor"
    return {"json": "a JSON value", "tree": "a list/dict of tensors"}[spec["kind"]]


__all__ = ["DTYPES", "Encoder", "IMAGE_MARK", "content_of", "decode_value", "from_cache", "images_from_cache",
           "images_to_cache", "merge_spec", "spec_of", "tensor_refs", "tensor_sha256", "to_cache"]
