"""The FLUX.2 family (FLUX.2-dev, FLUX.2-klein 4B / 9B and their base models): its spec, found by the family scan."""

from dataclasses import dataclass

from ...core.family import FamilySpec, text_tokenizer
from ...core.options import BOOL, option
from ...parts.qwen3 import qwen3_tokenizer_problem
from .components import COMPONENTS, LORA_TARGET_MODULES, bfl_dit_keys
from .pipeline import Flux2Pipeline

GROUP = "FLUX.2"


@dataclass(frozen=True)
class Flux2Options:
    edit_image_auto_resize: bool = option(True, "Edit images: scale and crop each to about 1024 x 1024 (default true, "
                                          "as the reference); false: encode them at their own size.", kind=BOOL,
                                          group=GROUP, sample=True)


FAMILY = FamilySpec(
    name="flux2",
    pipeline=Flux2Pipeline,
    components=COMPONENTS,
    # klein's Qwen3 needs a Qwen tokenizer: dev's Mistral one (the default when none is found) is refused there
    tokenizers=(text_tokenizer("tokenizer_path", "black-forest-labs/FLUX.2-dev:tokenizer/",
                               fits=qwen3_tokenizer_problem),),
    lora_target_modules=LORA_TARGET_MODULES,
    # the default target list names the single blocks' attn.to_out by a pattern (their number varies by model)
    lora_target_aliases={"dit": {"single_transformer_blocks.*.attn.to_out": "single_transformer_blocks.*.attn.to_out"}},
    lora_default_format="diffusers",
    # --full_format original: the DiT in BFL's single-file names (ComfyUI's and BFL's loaders, diffusers'
    # from_single_file)
    full_native_keys={"dit": bfl_dit_keys},
    # FLUX.2-dev's Mistral-3 text encoder and VAE are ERNIE-Image's kind too: a stage 1 naming them alone by hub id
    repositories=("black-forest-labs/FLUX.2-",),
    options=Flux2Options,
    unit_settings=lambda options: {"edit_image_auto_resize": bool(options.edit_image_auto_resize)},
    description="FLUX.2-dev, FLUX.2-klein 4B / 9B / base (diffusers Flux2Transformer2DModel, Mistral-3 or Qwen3, "
                "AutoencoderKLFlux2)",
)

__all__ = ["FAMILY", "Flux2Pipeline"]
