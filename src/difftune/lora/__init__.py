"""LoRA, shared by inference and training: inject through peft, export and import every common layout, fuse."""

from .apply import fuse_lora, load_lora_into
from .formats import (LAYOUTS, ImportedLora, component_prefix, load_lora_file, lora_layout_problem, save_lora,
                      to_comfyui, to_kohya, write_safetensors)
from .inject import canonical_lora_keys, expand_shared_lora, inject_lora, lora_state_dict, share_lora

__all__ = ["LAYOUTS", "ImportedLora", "canonical_lora_keys", "component_prefix", "expand_shared_lora", "fuse_lora",
           "inject_lora", "load_lora_file", "load_lora_into", "lora_layout_problem", "lora_state_dict", "save_lora",
           "share_lora", "to_comfyui", "to_kohya", "write_safetensors"]
