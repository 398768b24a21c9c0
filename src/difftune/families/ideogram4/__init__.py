"""The Ideogram-4 family (the bf16 repackage and ideogram-ai's releases): its spec, found by the family scan."""

from ...core.family import FamilySpec, text_tokenizer
from .components import COMPONENTS, LORA_TARGET_ALIASES, LORA_TARGET_MODULES, original_dit_keys
from .lora_names import convert_original_named_lora, ideogram4_lora_export_notes, original_lora_from_diffusers
from .pipeline import Ideogram4Pipeline


FAMILY = FamilySpec(
    name="ideogram4",
    pipeline=Ideogram4Pipeline,
    components=COMPONENTS,
    # the reference's default when a command names none
    tokenizers=(text_tokenizer("tokenizer_path", "ideogram-ai/ideogram-4-fp8:tokenizer/"),),
    lora_prefixes={"dit": "transformer", "dit_uncond": "unconditional_transformer"},
    lora_target_modules=LORA_TARGET_MODULES,
    lora_target_aliases={"dit": LORA_TARGET_ALIASES, "dit_uncond": LORA_TARGET_ALIASES},
    lora_converters=(convert_original_named_lora,),
    lora_native_names=original_lora_from_diffusers,
    # diffusers' layout: the only one diffusers reads once the reference's `adaln_modulation` has taken the final
    # layer's (its converter of the original names reads the blocks only); the reference's loader and ComfyUI read
    # --lora_format comfyui (lora_names.py)
    lora_default_format="diffusers",
    lora_export_notes=ideogram4_lora_export_notes,
    full_native_keys={"dit": original_dit_keys, "dit_uncond": original_dit_keys},
    description="Ideogram-4 (diffusers Ideogram4Transformer2DModel, conditional and unconditional; Qwen3-VL-8B; "
                "FLUX.2 autoencoder)",
)

__all__ = ["FAMILY", "Ideogram4Pipeline"]
