"""Qwen2.5-VL's processor (tokenizer + image processor; no video processor, which would need torchvision), for the
two FLUX.1 variants that read a prompt with Qwen2.5-VL: Nexus-Gen (its `processor/` folder) and Step1X-Edit (the
Qwen2.5-VL-7B-Instruct folder, with the reference's pixel bounds)."""

from __future__ import annotations

import os

from ...errors import UserError
from ...models.config import ModelConfig
from ...models.load import _directory
from ...util import first_line


def load_qwen_vl_processor(path_or_config: ModelConfig | str | os.PathLike, what: str, min_pixels: int | None = None,
                           max_pixels: int | None = None):
    """transformers' Qwen2VLProcessor of a folder holding preprocessor_config.json and the tokenizer."""
    from transformers import Qwen2Tokenizer, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path = _directory(path_or_config, what)
    if not (path / "preprocessor_config.json").is_file():
        raise UserError(f"{path}: no preprocessor_config.json (expected the {what} folder of Qwen2.5-VL)")

    class ImageOnlyQwen2VLProcessor(Qwen2VLProcessor):
        def check_argument_for_proper_class(self, argument_name, argument):
            if argument_name == "video_processor" and argument is None:
                return None
            return super().check_argument_for_proper_class(argument_name, argument)

    size = {} if min_pixels is None else {"size": {"shortest_edge": min_pixels, "longest_edge": max_pixels}}
    try:
        images = Qwen2VLImageProcessorPil.from_pretrained(str(path), **size)
        tokenizer = Qwen2Tokenizer.from_pretrained(str(path))
    except Exception as e:  # noqa: BLE001 - a broken folder is the user's to fix
        raise UserError(f"{path}: cannot load the Qwen2.5-VL processor ({first_line(e)})") from None
    return ImageOnlyQwen2VLProcessor(image_processor=images, tokenizer=tokenizer, video_processor=None)


__all__ = ["load_qwen_vl_processor"]
