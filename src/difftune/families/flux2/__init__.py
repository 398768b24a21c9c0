"""The FLUX.2 family (FLUX.2-dev, FLUX.2-klein 4B / 9B and their base models): its spec, found by the family scan."""

from dataclasses import dataclass

from ...core.family import FamilySpec, TokenizerSpec
from ...core.options import option
from ...models.load import load_tokenizer
from .components import COMPONENTS, LORA_TARGET_MODULES
from .pipeline import Flux2Pipeline

GROUP = "FLUX.2"


@dataclass(frozen=True)
class Flux2Options:
    tokenizer_path: str | None = option(None, "Tokenizer directory or model_id:folder/ (default: tokenizer/ beside "
                                        "the text encoder, else black-forest-labs/FLUX.2-dev:tokenizer/).",
                                        group=GROUP, sample=True)
    # difftune sample's inputs
    embedded_guidance: float | None = option(None, "FLUX.2-dev's distilled guidance (default: the family's, 4; "
                                             "klein has none).", kind=float, group=GROUP, sample=True, train=False)


FAMILY = FamilySpec(
    name="flux2",
    pipeline=Flux2Pipeline,
    components=COMPONENTS,
    tokenizers=(
        TokenizerSpec(attr="tokenizer", slot="text_encoder", folder="tokenizer", load=load_tokenizer,
                      flag="tokenizer_path", default="black-forest-labs/FLUX.2-dev:tokenizer/"),
    ),
    lora_prefixes={"dit": "transformer", "text_encoder": "text_encoder"},
    lora_target_modules=LORA_TARGET_MODULES,
    # the default target list names the single blocks' attn.to_out by a pattern (their number varies by model)
    lora_target_aliases={"dit": {"single_transformer_blocks.*.attn.to_out": "single_transformer_blocks.*.attn.to_out"}},
    lora_default_format="diffusers",
    data="image",
    options=Flux2Options,
    description="FLUX.2-dev, FLUX.2-klein 4B / 9B / base (diffusers Flux2Transformer2DModel, Mistral-3 or Qwen3, "
                "AutoencoderKLFlux2)",
)

__all__ = ["FAMILY", "Flux2Pipeline"]
