"""Small pieces several layers share: comma-separated name lists, a column of text lists, dtype names, pickle file
suffixes, the one-line form of an exception (for the one-line errors users see), and why a data file cannot be opened."""

from __future__ import annotations

import os

# Files that are (or may be) pickles: difftune never unpickles what a user hands it.
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")
# --torch_dtype names -> torch dtype names
DTYPE_NAMES = ("bfloat16", "float16", "float32")


def names(value) -> list[str]:
    """A comma-separated string or a list of names -> list (stripped, no empties, no repeats, in order)."""
    if value is None:
        return []
    items = value.split(",") if isinstance(value, str) else [str(v) for v in value if v is not None]
    out: list[str] = []
    for item in (i.strip() for i in items):
        if item and item not in out:
            out.append(item)
    return out


def text_list(value, column: str, where: str) -> list[str] | None:
    """A column (or call argument) that holds a list of strings: a list, a JSON list in a CSV cell, or a plain string
    (one item). `where` names the row (or the call) in the one-line errors."""
    import json

    from .errors import UserError

    if value is None:
        return None
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except ValueError as err:
            raise UserError(f"{where}: {column} is not a JSON list of strings ({err})") from None
    value = [value] if isinstance(value, str) else value
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UserError(f"{where}: {column} must be a list of strings, got {value!r:.60}")
    return value


def first_line(err: BaseException | str) -> str:
    """`TypeName: first line of the message` (just the type where there is no message)."""
    if isinstance(err, str):
        return (err.strip().splitlines() or [""])[0]
    text = (str(err).strip().splitlines() or [""])[0]
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def torch_dtype(value):
    """A torch dtype from a dtype or its name ("bfloat16", "torch.float16", ...); ValueError if it is none."""
    import torch

    if isinstance(value, torch.dtype):
        return value
    dtype = getattr(torch, str(value).replace("torch.", ""), None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"{value!r} is not a torch dtype (e.g. bfloat16, float16, float32)")
    return dtype


def non_finite(tensor) -> str | None:
    """'N NaN and M infinite value(s)' for a float tensor holding any, else None."""
    import torch

    if not tensor.is_floating_point():
        return None
    values = tensor.float() if tensor.element_size() == 1 else tensor  # float8: no isfinite of its own
    finite = torch.isfinite(values)
    if bool(finite.all()):
        return None
    nans = int(torch.isnan(values).sum())
    return f"{nans} NaN and {int((~finite).sum()) - nans} infinite value(s)"


def file_problem(path: str) -> str | None:
    """Why a data file cannot be read at all (missing, a folder, empty), or None; the readers say the rest."""
    if not os.path.exists(path):
        return "file not found"
    if os.path.isdir(path):
        return "is a folder, not a file"
    if os.path.getsize(path) == 0:
        return "file is empty (0 bytes)"
    return None
