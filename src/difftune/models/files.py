"""Reading weight files: safetensors, and the `.pth` / `.bin` files some official repositories ship instead (Wan-AI's
T5, VAE and CLIP weights; InstantX's FLUX IP-Adapter `ip-adapter.bin`, InfiniteYou's `image_proj_model.bin`).

A `.pth` or `.bin` is a pickle, and unpickling can run code: it is read only with `torch.load(weights_only=True)`,
which rebuilds tensors and plain containers and refuses everything else, and it must hold a flat {name: tensor}
state dict, or one level of such dicts ({"image_proj": {...}, "ip_adapter": {...}}, the IP-Adapter releases'
layout), read as "image_proj.<name>", "ip_adapter.<name>". Every other pickle format (.ckpt, .pt, ...) is
refused outright as weights.

`load_tensor` reads a file that holds one tensor (a release's `silence_latent.pt`, a torch.save of one float
tensor): `.pt` / `.pth` / `.bin` through the same `torch.load(weights_only=True)`, or a one-tensor safetensors.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator

import torch

from ..errors import UserError
from ..util import PICKLE_SUFFIXES, first_line

STATE_DICT_PICKLES = (".pth", ".bin")


def is_state_dict_pickle(path: str | os.PathLike) -> bool:
    return str(path).lower().endswith(STATE_DICT_PICKLES)


def _is_tensor_dict(obj) -> bool:
    return isinstance(obj, dict) and bool(obj) and \
        all(isinstance(k, str) and isinstance(v, torch.Tensor) for k, v in obj.items())


def load_pth(path: str | os.PathLike) -> dict[str, torch.Tensor]:
    """A `.pth` / `.bin` plain tensor state dict, memory-mapped where the file allows it."""
    path = str(path)
    if not os.path.isfile(path):
        raise UserError(f"{path}: no such file")
    try:
        try:
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:  # the legacy (non-zip) format cannot be memory-mapped
            if "mmap" not in str(e):
                raise
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except UserError:
        raise
    except Exception as e:  # noqa: BLE001 - every failure here is the file's
        raise UserError(f"{path}: not a plain tensor state dict that can be read safely "
                        f"(torch.load with weights_only=True refused this pickle: {first_line(e)})") from None
    if isinstance(obj, dict) and len(obj) == 1 and next(iter(obj)) in ("model_state", "state_dict") and \
            isinstance(next(iter(obj.values())), dict):  # some releases wrap the state dict once
        obj = next(iter(obj.values()))
    if isinstance(obj, dict) and obj and all(isinstance(k, str) and _is_tensor_dict(v) for k, v in obj.items()):
        # the IP-Adapter releases' layout: {"image_proj": {...}, "ip_adapter": {...}}
        return {f"{group}.{name}": t for group, part in obj.items() for name, t in part.items()}
    if not _is_tensor_dict(obj):
        raise UserError(f"{path}: holds a {type(obj).__name__}, not a plain {{name: tensor}} state dict (nor one "
                        f"level of them)")
    return obj


def refuse_pickle(path: str) -> None:
    if path.lower().endswith(PICKLE_SUFFIXES) and not is_state_dict_pickle(path):
        raise UserError(f"{path}: refusing to load a pickle checkpoint (loading one can run arbitrary code); "
                        f"use the model's .safetensors files or convert this one")


def iter_tensors(path: str | os.PathLike) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) for every tensor of a weight file, read one at a time where the format allows."""
    path = str(path)
    refuse_pickle(path)
    if is_state_dict_pickle(path):
        yield from load_pth(path).items()
        return
    from safetensors import safe_open

    with safe_open(path, framework="pt", device="cpu") as f:
        for key in f.keys():
            yield key, f.get_tensor(key)


TENSOR_PICKLES = (".pt", ".pth", ".bin")


def _pickle_problem(err: BaseException) -> str:
    """torch.load's multi-paragraph refusal -> the one reason that matters."""
    text = str(err)
    named = re.search(r"GLOBAL ([\w.]+)", text)
    if named:
        return (f"refused: the pickle names {named.group(1)}, which torch.load(weights_only=True) does not rebuild; "
                f"only tensors and plain containers are loaded, as unpickling anything else can run code")
    if not text.startswith("Weights only load failed"):
        return f"not a file torch.save wrote, or a damaged one ({first_line(err).split('. ')[0]})"
    skip = ("Weights only load failed", "Please file an issue", "Check the documentation")
    lines = [line.strip() for line in text.splitlines() if line.strip() and not line.strip().startswith(skip)]
    return f"not a file torch.save wrote, or a damaged one ({lines[0] if lines else first_line(err)})"


def _a(obj) -> str:
    name = type(obj).__name__
    return f"{'an' if name[:1].lower() in 'aeiou' else 'a'} {name}"


def _names(names: list[str]) -> str:
    return ", ".join(names[:3]) + ("..." if len(names) > 3 else "")


def load_tensor(path: str | os.PathLike) -> torch.Tensor:
    """The one tensor a file holds: `.pt` / `.pth` / `.bin` (a bare tensor, or a dict whose only value is one),
    read only with torch.load(weights_only=True), or a `.safetensors` of one tensor. UserError otherwise."""
    path = str(path)
    lower = path.lower()
    if not lower.endswith(TENSOR_PICKLES + (".safetensors",)):
        suffix = os.path.splitext(path)[1] or "(no suffix)"
        raise UserError(f"{path}: a tensor is read from a {', '.join(TENSOR_PICKLES)} or .safetensors file, "
                        f"not '{suffix}'")
    if not os.path.isfile(path):
        raise UserError(f"{path}: no such file")
    if lower.endswith(".safetensors"):
        from safetensors import safe_open

        try:
            with safe_open(path, framework="pt", device="cpu") as f:
                names = list(f.keys())
                if len(names) == 1:
                    return f.get_tensor(names[0])
        except Exception as e:  # noqa: BLE001 - every failure here is the file's
            raise UserError(f"{path}: not a readable safetensors file ({first_line(e)})") from None
        if not names:
            raise UserError(f"{path}: holds no tensors: expected one")
        raise UserError(f"{path}: holds {len(names)} tensors ({_names(names)}): expected one")
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # noqa: BLE001 - every failure here is the file's
        raise UserError(f"{path}: {_pickle_problem(e)}") from None
    if isinstance(obj, dict):
        tensors = [str(k) for k, v in obj.items() if isinstance(v, torch.Tensor)]
        if len(obj) == 1 and tensors:
            return next(iter(obj.values()))
        if len(tensors) > 1:
            raise UserError(f"{path}: holds {len(tensors)} tensors ({_names(tensors)}): expected one")
        if not obj:
            raise UserError(f"{path}: holds an empty dict, not a tensor")
        if len(obj) == 1:
            key, value = next(iter(obj.items()))
            raise UserError(f"{path}: holds a dict whose one entry ({key}) is {_a(value)}, not a tensor")
        raise UserError(f"{path}: holds a dict of {len(obj)} entries ({_names([str(k) for k in obj])}), "
                        f"not one tensor")
    if not isinstance(obj, torch.Tensor):
        raise UserError(f"{path}: holds {_a(obj)}, not a tensor")
    return obj
