"""Helpers of Qwen-Image's features (core `Feature` subclasses) for their columns of a training row and their inputs
of a call. The reference's forms hold: an image column no flag loads (--data_file_keys / --extra_inputs) is no
input, and a call's input is every prompt's (one copy per prompt of the batch)."""

from __future__ import annotations

from PIL import Image


def loaded(value):
    """An image column's value when the data set loaded it; a column no flag names stays file names and is not used,
    as in the reference."""
    images = value if isinstance(value, list) else [value]
    return value if value is not None and images and all(isinstance(v, Image.Image) for v in images) else None




def sizes(value):
    """An image's size, a list's sizes (a stage-1 batch signature's part)."""
    return value.size if isinstance(value, Image.Image) else \
        tuple(getattr(i, "size", i) for i in value) if isinstance(value, list) else value


def per_prompt(value, batch: int):
    return value if value is None or batch == 1 else [value] * batch


__all__ = ["loaded", "per_prompt", "sizes"]
