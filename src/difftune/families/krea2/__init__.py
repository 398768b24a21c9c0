"""The Krea-2 family (Krea-2 Raw and Turbo): its spec, found by the family scan."""

import os
from dataclasses import dataclass

from ...core.family import FamilySpec, text_tokenizer
from ...core.options import SWITCH, option
from .components import COMPONENTS, LORA_TARGET_MODULES, REFERENCE_LORA_TARGETS, original_dit_keys
from .lora import convert_original_krea2_lora, krea2_lora_native_names
from .pipeline import Krea2Pipeline

GROUP = "Krea-2"


@dataclass(frozen=True)
class Krea2Options:
    tokenizer_path: str | None = option(None, "Tokenizer directory or model_id:folder/ (default: the text encoder's "
                                        "own folder, else Qwen/Qwen3-VL-4B-Instruct:).", group=GROUP, sample=True)
    align_to_opensource_format: bool = option(False, "The reference's Krea-2 flag: write the LoRA in diffusers' "
                                              "names behind transformer. (its 'open-source' format), which is "
                                              "difftune's default file; the same as --lora_format diffusers.",
                                              kind=SWITCH, group=GROUP)

    def __post_init__(self):
        # The reference names Qwen3-VL's repository root ("Qwen/Qwen3-VL-4B-Instruct:"), where the tokenizer sits
        # beside the weights: its tokenizer.json (with the JSON files beside it) stands for that folder.
        path = self.tokenizer_path
        if isinstance(path, str) and path.endswith(":") and not os.path.exists(path):
            object.__setattr__(self, "tokenizer_path", path + "tokenizer.json")

    def lora_format(self) -> tuple[str, str] | None:
        """(the LoRA layout these flags ask for, the flag), or None: --lora_format decides."""
        return ("diffusers", "--align_to_opensource_format") if self.align_to_opensource_format else None


FAMILY = FamilySpec(
    name="krea2",
    pipeline=Krea2Pipeline,
    components=COMPONENTS,
    tokenizers=(
        # Qwen3-VL keeps its tokenizer beside its weights; the reference's default is that repository's root
        text_tokenizer("tokenizer_path", "Qwen/Qwen3-VL-4B-Instruct:tokenizer.json", folder=""),
    ),
    lora_target_modules=LORA_TARGET_MODULES,
    lora_target_aliases={"dit": REFERENCE_LORA_TARGETS},
    lora_converters=(convert_original_krea2_lora,),
    lora_native_names=krea2_lora_native_names,
    # transformer.<diffusers path>.lora_A/B.weight, alpha folded: what diffusers' Krea2LoraLoaderMixin, ComfyUI's
    # Krea2 key map and the reference's Krea2LoRALoader (its "open-source format") all read
    lora_default_format="diffusers",
    full_native_keys={"dit": original_dit_keys},
    options=Krea2Options,
    description="Krea-2 Raw and Turbo (diffusers Krea2Transformer2DModel, Qwen3-VL-4B, Qwen-Image VAE)",
)

__all__ = ["FAMILY", "Krea2Pipeline"]
