"""Qwen2.5-VL-7B-Instruct: its config, its checkpoint names and its processors (tokenizer + Qwen2-VL image
processor). Qwen-Image reads prompts with it; FLUX.1's Step1X-Edit and Nexus-Gen build on it."""

from __future__ import annotations

import os

from ..errors import UserError
from ..models.config import ModelConfig
from ..models.load import load_tokenizer, model_directory
from ..util import first_line

QWEN25_VL_7B_CONFIG = {
    "architectures": ["Qwen2_5_VLForConditionalGeneration"],
    "attention_dropout": 0.0,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "vision_start_token_id": 151652,
    "vision_end_token_id": 151653,
    "vision_token_id": 151654,
    "image_token_id": 151655,
    "video_token_id": 151656,
    "hidden_act": "silu",
    "hidden_size": 3584,
    "initializer_range": 0.02,
    "intermediate_size": 18944,
    "max_position_embeddings": 128000,
    "max_window_layers": 28,
    "model_type": "qwen2_5_vl",
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-06,
    "rope_theta": 1000000.0,
    "sliding_window": 32768,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "use_sliding_window": False,
    "vision_config": {
        "depth": 32,
        "hidden_act": "silu",
        "hidden_size": 1280,
        "intermediate_size": 3420,
        "num_heads": 16,
        "in_chans": 3,
        "out_hidden_size": 3584,
        "patch_size": 14,
        "spatial_merge_size": 2,
        "spatial_patch_size": 14,
        "window_size": 112,
        "fullatt_block_indexes": [7, 15, 23, 31],
        "tokens_per_second": 2,
        "temporal_patch_size": 2,
    },
    "rope_scaling": {"type": "mrope", "mrope_section": [16, 24, 24]},
    "vocab_size": 152064,
}


def qwen25_vl_key(key: str) -> str:
    """Qwen2.5-VL checkpoint names -> transformers>=4.52 module names.

    The official files (and transformers 5's `save_pretrained`) use `model.layers.*`, `visual.*`; the module
    tree is `model.language_model.*`, `model.visual.*`. Names already in the new layout are unchanged.
    """
    if key.startswith(("model.language_model.", "model.visual.")):
        return key
    if key.startswith("visual."):
        return "model." + key
    if key.startswith("model."):
        return "model.language_model." + key[len("model."):]
    return key


# -- processors -----------------------------------------------------------------------------------------------

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
    """A model's `processor/` folder: Qwen2-VL image processor (PIL backend) + tokenizer."""
    path = model_directory(path_or_config, "processor")
    if not (path / "preprocessor_config.json").is_file():
        raise UserError(f"{path}: no preprocessor_config.json (expected the model's processor/ folder)")
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    try:
        image_processor = Qwen2VLImageProcessorPil.from_pretrained(str(path))
    except Exception as e:
        raise UserError(f"{path}: cannot load the image processor ({first_line(e)})") from e
    return VLProcessor(image_processor, load_tokenizer(path))


def load_qwen_vl_processor(path_or_config: ModelConfig | str | os.PathLike, what: str, min_pixels: int | None = None,
                           max_pixels: int | None = None):
    """transformers' Qwen2VLProcessor (no video processor, which would need torchvision) of a folder holding
    preprocessor_config.json and the tokenizer: for models that read a prompt with images through Qwen2.5-VL's chat
    template; `min_pixels` / `max_pixels` bound the image processor's resize."""
    from transformers import Qwen2Tokenizer, Qwen2VLProcessor
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil

    path = model_directory(path_or_config, what)
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


__all__ = ["QWEN25_VL_7B_CONFIG", "VLProcessor", "load_processor", "load_qwen_vl_processor", "qwen25_vl_key"]
