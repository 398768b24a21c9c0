"""Batching per-sample values into one dict with a leading batch dimension, and splitting a batch back."""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import torch


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
