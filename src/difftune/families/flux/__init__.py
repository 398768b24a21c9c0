"""The FLUX.1 family (FLUX.1-dev / -schnell in the diffusers layout): its spec, registered by name."""

from ...core.family import FamilySpec, TokenizerSpec
from ...models.load import load_tokenizer
from .components import (DIT, DIT_BFL, LORA_TARGET_MODULES, REFERENCE_LORA_TARGETS, TEXT_ENCODER, TEXT_ENCODER_2,
                         VAE, VAE_BFL)
from .bfl import bfl_lora_from_diffusers, convert_bfl_named_flux_lora
from .pipeline import FluxImagePipeline

FAMILY = FamilySpec(
    name="flux",
    pipeline=FluxImagePipeline,
    components=(DIT, TEXT_ENCODER, TEXT_ENCODER_2, VAE, DIT_BFL, VAE_BFL),
    tokenizers=(
        TokenizerSpec(attr="tokenizer_1", slot="text_encoder", folder="tokenizer", load=load_tokenizer,
                      flag="tokenizer_1_path"),
        TokenizerSpec(attr="tokenizer_2", slot="text_encoder_2", folder="tokenizer_2", load=load_tokenizer,
                      flag="tokenizer_2_path"),
    ),
    lora_prefixes={"dit": "transformer", "text_encoder": "text_encoder", "text_encoder_2": "text_encoder_2"},
    lora_target_modules=LORA_TARGET_MODULES,
    lora_target_aliases={"dit": REFERENCE_LORA_TARGETS},
    lora_converters=(convert_bfl_named_flux_lora,),
    lora_native_names=bfl_lora_from_diffusers,
    data="image",
    sample_defaults={"height": 1024, "width": 1024, "num_inference_steps": 30, "cfg_scale": 1.0,
                     "embedded_guidance": 3.5},
    description="FLUX.1-dev / -schnell (diffusers FluxTransformer2DModel, AutoencoderKL, CLIP-L, T5-XXL)",
)

__all__ = ["FAMILY", "FluxImagePipeline"]
