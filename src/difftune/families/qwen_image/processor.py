"""Qwen-Image-Edit's image processor: the Qwen2-VL image processor of a `processor/` folder plus its tokenizer."""

from __future__ import annotations

import os

from ...errors import UserError
from ...models.config import ModelConfig
from ...models.load import _directory, load_tokenizer
from ...util import first_line


class VLProcessor:
    """The image processor and tokenizer of a Qwen2-VL `processor/` folder.

    transformers' own Qwen2VLProcessor also builds a video processor, which needs torchvision; the
    pipeline only needs images. Calls and attributes (merge_size, patch_size, ...) go to the image processor.
    """

    def __init__(self, image_processor, tokenizer):
        self.image_processor = image_processor
        self.tokenizer = tokenizer

    def __call__(self, images=None, **kwargs):
        return self.image_processor(images=images, **kwargs)

    def __getattr__(self, name):
        if name.startswith("__") or name in ("image_processor", "tokenizer"):
            raise AttributeError(name)
        return getattr(self.image_processor, name)


def load_processor(path_or_config: ModelConfig | str | os.PathLike) -> VLProcessor:
    """The edit model's `processor/` folder: Qwen2-VL image processor (PIL backend) + tokenizer."""
    path = _directory(path_or_config, "processor")
    if not (path / "preprocessor_config.json").is_file():
        raise UserError(f"{path}: no preprocessor_config.json (expected the model's processor/ folder)")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    try:
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(path))
    except Exception as e:
        raise UserError(f"{path}: cannot load the image processor ({first_line(e)})") from e
    return VLProcessor(image_processor, load_tokenizer(path))
