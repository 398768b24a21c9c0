"""Model loading, generic: where weights are (`ModelConfig`), which model they are among a family's components,
building it on the meta device and loading it, FP8 storage."""

from .config import ModelConfig, check_fp8_slots, parse_model_configs
from .detect import ComponentSpec, DetectedComponent, HeaderMatch, detect_component, match_header, read_header
from .fp8 import check_fp8_frozen, enable_fp8_storage
from .load import LoadedComponent, load_component, load_tokenizer, model_directory
from .quant import check_quant_frozen

__all__ = [
    "ComponentSpec", "DetectedComponent", "check_fp8_slots", "HeaderMatch", "LoadedComponent", "ModelConfig", "check_fp8_frozen", "check_quant_frozen",
    "detect_component", "enable_fp8_storage", "load_component", "load_tokenizer", "match_header", "model_directory",
    "parse_model_configs", "read_header",
]
