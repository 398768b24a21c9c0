"""The Stable Diffusion 1.x family (stable-diffusion-v1-5 and its fine-tunes): its spec, found by the family scan."""

from ...core.family import FamilySpec, text_tokenizer
from .components import COMPONENTS, LORA_TARGET_MODULES
from .pipeline import StableDiffusionPipeline

FAMILY = FamilySpec(
    name="stable_diffusion",
    pipeline=StableDiffusionPipeline,
    components=COMPONENTS,
    tokenizers=(text_tokenizer("tokenizer_path", "AI-ModelScope/stable-diffusion-v1-5:tokenizer/"),),
    lora_prefixes={"unet": "unet", "text_encoder": "text_encoder"},
    lora_target_modules=LORA_TARGET_MODULES,
    # kohya's names (lora_unet_<diffusers path>, lora_down / lora_up, alpha): what A1111, Forge, ComfyUI and diffusers
    # all read for SD 1.x (docs/stable_diffusion.md)
    lora_default_format="kohya",
    repositories=("AI-ModelScope/stable-diffusion-v1-5", "stable-diffusion-v1-5/stable-diffusion-v1-5",
                  "runwayml/stable-diffusion-v1-5"),
    description="Stable Diffusion 1.x (diffusers UNet2DConditionModel, CLIP-L, KL-f8 VAE; epsilon prediction)",
)

__all__ = ["FAMILY", "StableDiffusionPipeline"]
