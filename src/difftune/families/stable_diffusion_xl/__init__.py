"""The Stable Diffusion XL family (stable-diffusion-xl-base-1.0 and its fine-tunes): its spec, found by the family
scan."""

from dataclasses import dataclass

from ...core.family import FamilySpec, TokenizerSpec, text_tokenizer
from ...core.options import SWITCH, option
from ...models.load import load_tokenizer
from .components import COMPONENTS, LORA_TARGET_MODULES
from .lora_names import kohya_from_ldm, ldm_names
from .pipeline import StableDiffusionXLPipeline

REPO = "stabilityai/stable-diffusion-xl-base-1.0"


@dataclass(frozen=True)
class SDXLOptions:
    align_to_opensource_format: bool = option(False, "The reference's SDXL flag: write the LoRA in kohya's layout "
                                              "with the original (LDM) UNet names (lora_unet_input_blocks_4_1_..., "
                                              "lora_down/lora_up, an alpha per layer), as A1111, Forge and ComfyUI "
                                              "read; the same as --lora_format kohya.", kind=SWITCH, group="SDXL")

    def lora_format(self) -> tuple[str, str] | None:
        return ("kohya", "--align_to_opensource_format") if self.align_to_opensource_format else None


FAMILY = FamilySpec(
    name="stable_diffusion_xl",
    pipeline=StableDiffusionXLPipeline,
    components=COMPONENTS,
    options=SDXLOptions,
    tokenizers=(
        text_tokenizer("tokenizer_path", f"{REPO}:tokenizer/"),
        TokenizerSpec(attr="tokenizer_2", slot="text_encoder_2", folder="tokenizer_2", load=load_tokenizer,
                      flag="tokenizer_2_path", default=f"{REPO}:tokenizer_2/",
                      help="The bigG tokenizer: a directory or model_id:folder/ (default: tokenizer_2/ beside the "
                           "second text encoder)."),
    ),
    lora_prefixes={"unet": "unet", "text_encoder": "text_encoder", "text_encoder_2": "text_encoder_2"},
    lora_target_modules=LORA_TARGET_MODULES,
    # kohya's layout in the original UNet names: what A1111, Forge, ComfyUI and diffusers read for SDXL
    lora_default_format="kohya",
    lora_native_names=ldm_names,
    lora_converters=(kohya_from_ldm,),
    repositories=(REPO,),
    description="Stable Diffusion XL (diffusers UNet2DConditionModel, CLIP-L + bigG, KL-f8 VAE; epsilon prediction)",
)

__all__ = ["FAMILY", "StableDiffusionXLPipeline"]
