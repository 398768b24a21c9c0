"""The FLUX.1 family (FLUX.1-dev / -schnell / Krea / Kontext): its spec, found by the family scan."""

from dataclasses import dataclass

from ...core.family import FamilySpec, TokenizerSpec
from ...core.options import SWITCH, option
from ...models.load import load_tokenizer
from .components import (DIT, DIT_BFL, LORA_TARGET_MODULES, REFERENCE_LORA_TARGETS, TEXT_ENCODER, TEXT_ENCODER_2,
                         VAE, VAE_BFL)
from .bfl import bfl_lora_from_diffusers, convert_bfl_named_flux_lora
from .pipeline import FluxImagePipeline

GROUP = "FLUX.1"


@dataclass(frozen=True)
class FluxOptions:
    tokenizer_1_path: str | None = option(None, "The CLIP tokenizer: a directory or model_id:folder/ (default: "
                                          "tokenizer/ beside the CLIP text encoder).", group=GROUP, sample=True)
    tokenizer_2_path: str | None = option(None, "The T5 tokenizer: a directory or model_id:folder/ (default: "
                                          "tokenizer_2/ beside the T5 encoder).", group=GROUP, sample=True)
    align_to_opensource_format: bool = option(False, "Accepted for the reference's FLUX scripts: difftune's LoRA "
                                              "files are already in the open (diffusers) layout; see --lora_format.",
                                              kind=SWITCH, group=GROUP)
    # difftune sample's inputs
    embedded_guidance: float | None = option(None, "FLUX.1-dev's distilled guidance (default: the family's, 3.5).",
                                             kind=float, group=GROUP, sample=True, train=False)
    kontext_images: list | None = option(None, "FLUX.1 Kontext: a reference image (repeat for several).",
                                         repeat=True, load="RGB", group=GROUP, sample=True, train=False)

    def notes(self) -> list[str]:
        if self.align_to_opensource_format:
            return ["--align_to_opensource_format is not needed: difftune saves LoRAs in the open diffusers layout "
                    "(FluxPipeline.load_lora_weights reads them; --lora_format picks another: for FLUX, "
                    "--lora_format kohya writes BFL's kohya names, the layout this flag gives in DiffSynth-Studio)"]
        return []


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
    options=FluxOptions,
    description="FLUX.1-dev / -schnell (diffusers FluxTransformer2DModel, AutoencoderKL, CLIP-L, T5-XXL)",
)

__all__ = ["FAMILY", "FluxImagePipeline"]
