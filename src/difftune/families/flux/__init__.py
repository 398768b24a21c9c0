"""The FLUX.1 family (FLUX.1-dev / -schnell / Krea / Kontext): its spec, found by the family scan."""

from dataclasses import dataclass

from ...core.family import FamilySpec, TokenizerSpec
from ...core.options import SWITCH, option
from ...models.load import load_tokenizer
from .components import (DIT, DIT_BFL, LORA_TARGET_MODULES, REFERENCE_LORA_TARGETS, TEXT_ENCODER, TEXT_ENCODER_2,
                         VAE, VAE_BFL)
from .bfl import bfl_lora_from_diffusers, convert_bfl_named_flux_lora, flux_lora_export_notes
from .pipeline import FluxImagePipeline

GROUP = "FLUX.1"


@dataclass(frozen=True)
class FluxOptions:
    tokenizer_1_path: str | None = option(None, "The CLIP tokenizer: a directory or model_id:folder/ (default: "
                                          "tokenizer/ beside the CLIP text encoder).", group=GROUP, sample=True)
    tokenizer_2_path: str | None = option(None, "The T5 tokenizer: a directory or model_id:folder/ (default: "
                                          "tokenizer_2/ beside the T5 encoder).", group=GROUP, sample=True)
    align_to_opensource_format: bool = option(False, "The reference's FLUX flag: write the LoRA in the kohya layout "
                                              "(lora_unet_double_blocks_*, lora_down/lora_up, an alpha per layer), "
                                              "as it does; the same as --lora_format kohya.", kind=SWITCH,
                                              group=GROUP)
    # difftune sample's inputs
    embedded_guidance: float | None = option(None, "FLUX.1-dev's distilled guidance (default: the family's, 3.5).",
                                             kind=float, group=GROUP, sample=True, train=False)
    kontext_images: list | None = option(None, "FLUX.1 Kontext: a reference image (repeat for several).",
                                         repeat=True, load="RGB", group=GROUP, sample=True, train=False)

    def lora_format(self) -> tuple[str, str] | None:
        """(the LoRA layout these flags ask for, the flag), or None: --lora_format decides."""
        return ("kohya", "--align_to_opensource_format") if self.align_to_opensource_format else None


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
    # The reference's `proj_out` reaches its single blocks' output layers only (its final layer is `final_proj_out`);
    # diffusers calls both `proj_out`, so the name keeps the reference's meaning here.
    lora_target_aliases={"dit": {**REFERENCE_LORA_TARGETS, "proj_out": "single_transformer_blocks.*.proj_out"}},
    lora_converters=(convert_bfl_named_flux_lora,),
    lora_native_names=bfl_lora_from_diffusers,
    lora_export_notes=flux_lora_export_notes,
    data="image",
    options=FluxOptions,
    description="FLUX.1-dev / -schnell (diffusers FluxTransformer2DModel, AutoencoderKL, CLIP-L, T5-XXL)",
)

__all__ = ["FAMILY", "FluxImagePipeline"]
