"""Batching per-sample values into one dict with a leading batch dimension, and splitting a batch back.

How a value batches is declared, not guessed from the first sample: each unit's `batching` says it for the
values it writes, the pipeline's `input_batching` for values that come with the data. The kinds:

* `STACK` (what an undeclared tensor does): equal shapes, stacked;
* `Pad(mask)`: a variable-length sequence (dim 0) padded with zeros to the longest, with its mask;
* `SCALAR`: one number per sample, kept as a list (or a (B,) tensor for 0-dim tensors);
* `LIST`: kept per sample as a list (e.g. several edit images of one sample);
* `SAME`: must be equal in every sample of a batch, kept once (e.g. direct_distill's step count).

Anything that cannot be batched is a one-line `UserError` naming the value and the samples.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import UserError

STACK, SCALAR, LIST, SAME = "stack", "scalar", "list", "same"
KINDS = (STACK, SCALAR, LIST, SAME)


@dataclass(frozen=True)
class Pad:
    mask: str  # the name of the value's mask (1 for real positions, 0 for padding)


def normalize(rules: Mapping[str, Any] | None) -> dict[str, Any]:
    """A rule that is a plain name other than a kind is a mask: `{"prompt_embeds": "prompt_embeds_mask"}`."""
    return {k: Pad(r) if isinstance(r, str) and r not in KINDS else r for k, r in (rules or {}).items()}


def masks_of(rules: Mapping[str, Any] | None) -> dict[str, str]:
    """{value: its mask} for the padded values among `rules`."""
    return {k: r.mask for k, r in normalize(rules).items() if isinstance(r, Pad)}


def _who(ids: Sequence | None, i: int) -> str:
    return f"sample {ids[i]}" if ids is not None and i < len(ids) else f"sample {i + 1} of the batch"


def collate_values(samples: list[dict[str, Any]], rules: Mapping[str, Any] | None = None,
                   ids: Sequence | None = None) -> dict[str, Any]:
    """Batch per-sample values (no batch dimension) into one dict (leading batch dimension) by `rules`
    (name -> kind); `ids` name the samples in errors."""
    rules = normalize(rules)
    masks = set(masks_of(rules).values())
    out: dict[str, Any] = {}
    for key in samples[0].keys():
        if key in masks:
            continue  # batched with its value
        vals = [s.get(key) for s in samples]
        rule = rules.get(key, STACK)
        if all(v is None for v in vals):
            out[key] = None
        elif isinstance(rule, Pad):
            _pad(out, key, vals, samples, rule.mask, ids)
        elif rule == SAME:
            for i, v in enumerate(vals[1:], 1):
                if not _equal(v, vals[0]):
                    raise UserError(f"cannot batch '{key}': {_who(ids, 0)} has {_show(vals[0])} but {_who(ids, i)} "
                                    f"has {_show(v)}; samples of one batch must agree on it (--batch_size 1 avoids it)")
            out[key] = vals[0]
        elif rule == SCALAR and all(isinstance(v, torch.Tensor) and v.dim() == 0 for v in vals):
            out[key] = torch.stack(vals)
        elif rule in (LIST, SCALAR) or not all(isinstance(v, torch.Tensor) for v in vals):
            out[key] = vals
        else:
            shapes = [tuple(v.shape) for v in vals]
            odd = next((i for i, s in enumerate(shapes) if s != shapes[0]), None)
            if odd is not None:
                raise UserError(f"cannot batch '{key}': {_who(ids, 0)} has shape {list(shapes[0])} but "
                                f"{_who(ids, odd)} has {list(shapes[odd])} (samples of one batch must have equal "
                                f"shapes: batches are formed from samples of one bucket)")
            out[key] = torch.stack(vals)
    return out


def _pad(out: dict, key: str, vals: list, samples: list[dict], mask_key: str, ids) -> None:
    bad = next((i for i, v in enumerate(vals) if not isinstance(v, torch.Tensor) or v.dim() == 0), None)
    if bad is not None:
        raise UserError(f"cannot batch '{key}': {_who(ids, bad)} has {_show(vals[bad])}, not a sequence")
    length = max(v.shape[0] for v in vals)
    out[key] = torch.stack([torch.nn.functional.pad(v, (0, 0) * (v.dim() - 1) + (0, length - v.shape[0]))
                            for v in vals])
    if all(isinstance(s.get(mask_key), torch.Tensor) for s in samples):
        out[mask_key] = torch.stack([
            torch.nn.functional.pad(s[mask_key], (0, length - s[mask_key].shape[0])) for s in samples])


def _equal(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape and \
            bool(torch.equal(a, b))
    return a == b


def _show(v) -> str:
    if isinstance(v, torch.Tensor):
        return f"a tensor of shape {list(v.shape)}"
    text = repr(v)
    return text if len(text) <= 40 else text[:37] + "..."


def split_batch(values: dict[str, Any], batch_size: int, rules: Mapping[str, Any] | None,
                names: Iterable[str]) -> list[dict[str, Any]]:
    """The inverse of `collate_values` for the given names: one dict per sample, padding removed."""
    padded = masks_of(rules)
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
