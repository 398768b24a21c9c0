"""The FLUX.2 family (FLUX.2-dev, FLUX.2-klein 4B / 9B and their base models): its spec, found by the family scan."""

from dataclasses import dataclass

from ...core.family import FamilySpec, TokenizerSpec
from ...core.options import BOOL, option
from ...models.load import load_tokenizer
from .components import COMPONENTS, LORA_TARGET_MODULES, bfl_dit_keys
from .pipeline import Flux2Pipeline

GROUP = "FLUX.2"


@dataclass(frozen=True)
class Flux2Options:
    tokenizer_path: str | None = option(None, "Tokenizer directory or model_id:folder/ (default: tokenizer/ beside "
                                        "the text encoder, else black-forest-labs/FLUX.2-dev:tokenizer/).",
                                        group=GROUP, sample=True)
    edit_image_auto_resize: bool = option(True, "Edit images: scale and crop each to about 1024 x 1024 (default true, "
                                          "as the reference); false: encode them at their own size.", kind=BOOL,
                                          group=GROUP, sample=True)
    # difftune sample's inputs
    embedded_guidance: float | None = option(None, "FLUX.2-dev's distilled guidance (default: the family's, 4; "
                                             "klein has none).", kind=float, group=GROUP, sample=True, train=False)
    edit_image: list | None = option(None, "An edit (reference) image; repeat it for several.", repeat=True,
                                     load="RGB", group=GROUP, sample=True, train=False)

    def call_inputs(self, images: dict) -> dict:
        """`difftune sample`'s inputs as pipeline arguments (`images`: the image flags, loaded)."""
        out = {k: v for k, v in images.items() if v is not None}
        if self.embedded_guidance is not None:
            out["embedded_guidance"] = self.embedded_guidance
        if out.get("edit_image") is not None:
            out["edit_image_auto_resize"] = bool(self.edit_image_auto_resize)
        return out


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
