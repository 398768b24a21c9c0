"""What a Qwen-Image feature adds to the core `Feature`: how its columns of a training row and its inputs of a call
become values. The reference's forms hold: an image column no flag loads (--data_file_keys / --extra_inputs) is no
input, and a call's input is every prompt's (one copy per prompt of the batch)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from PIL import Image

from ...core.features import Feature


def loaded(value):
    """An image column's value when the data set loaded it; a column no flag names stays file names and is not used,
    as in the reference."""
    images = value if isinstance(value, list) else [value]
    return value if value is not None and images and all(isinstance(v, Image.Image) for v in images) else None


def row_label(data: Mapping[str, Any]):
    """The row as messages name it (counted from 1)."""
    row = data.get("_row", "?")
    return row + 1 if isinstance(row, int) else row


def sizes(value):
    """An image's size, a list's sizes (a stage-1 batch signature's part)."""
    return value.size if isinstance(value, Image.Image) else \
        tuple(getattr(i, "size", i) for i in value) if isinstance(value, list) else value


def per_prompt(value, batch: int):
    return value if value is None or batch == 1 else [value] * batch


class QwenImageFeature(Feature):
    def row_values(self, data: Mapping[str, Any]) -> dict[str, Any]:
        """Its columns of one training row as pipeline inputs (one-line errors naming the row)."""
        return {}

    def call_values(self, given: Mapping[str, Any], values: Mapping[str, Any]) -> dict[str, Any]:
        """Its inputs of a call (`given`) as values, for the call's prompts (`values`: batch_size, negative_prompt):
        by default one copy of each per prompt."""
        return {name: per_prompt(given.get(name), values["batch_size"]) for name in self.call_inputs}

    def signature(self, sample: Mapping[str, Any]) -> tuple:
        """What samples encoded in one stage-1 batch must share of its columns (`batch_signature`)."""
        return ()

    def batch_values(self, values: dict[str, Any], samples: int) -> None:
        """Its values of a stage-1 batch of `samples` samples, put in their batched form."""


__all__ = ["QwenImageFeature", "loaded", "per_prompt", "row_label", "sizes"]
