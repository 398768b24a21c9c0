"""Model loading: where weights are (`ModelConfig`), which model they are, building it, FP8 storage."""

from .config import ModelConfig, parse_model_configs
from .fp8 import check_fp8_frozen, enable_fp8_storage
from .loader import (
    ComponentSpec, DetectedComponent, HeaderMatch, LoadedComponent, VLProcessor, component_names, detect_component,
    load_component, load_processor, load_tokenizer, match_header, read_header, register_spec, specs)
from . import qwen_image  # noqa: F401,E402  (registers the Qwen-Image components)

__all__ = [
    "ComponentSpec", "DetectedComponent", "HeaderMatch", "LoadedComponent", "ModelConfig", "VLProcessor",
    "check_fp8_frozen", "component_names", "detect_component", "enable_fp8_storage", "load_component",
    "load_processor", "load_tokenizer", "match_header", "parse_model_configs", "read_header", "register_spec",
    "specs",
]
