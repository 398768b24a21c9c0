"""The ERNIE-Image family (PaddlePaddle/ERNIE-Image): its spec, found by the family scan."""

from dataclasses import dataclass

from ...core.family import FamilySpec, TokenizerSpec
from ...core.options import option
from ...models.load import load_tokenizer
from .components import COMPONENTS, LORA_TARGET_MODULES
from .pipeline import ErnieImagePipeline

GROUP = "ERNIE-Image"


@dataclass(frozen=True)
class ErnieImageOptions:
    tokenizer_path: str | None = option(None, "Tokenizer directory or model_id:folder/ (default: tokenizer/ beside "
                                        "the text encoder, else PaddlePaddle/ERNIE-Image:tokenizer/).", group=GROUP,
                                        sample=True)


FAMILY = FamilySpec(
    name="ernie_image",
    pipeline=ErnieImagePipeline,
    components=COMPONENTS,
    tokenizers=(
        TokenizerSpec(attr="tokenizer", slot="text_encoder", folder="tokenizer", load=load_tokenizer,
                      flag="tokenizer_path", default="PaddlePaddle/ERNIE-Image:tokenizer/"),
    ),
    lora_prefixes={"dit": "transformer", "text_encoder": "text_encoder"},
    lora_target_modules=LORA_TARGET_MODULES,
    # the reference's DiT has diffusers' module names, so no renaming either way
    lora_native_names=None,
    # diffusers' ErnieImageLoraLoaderMixin refuses files holding `.alpha` tensors, so the default is diffusers'
    # layout (alpha folded into B); the reference's loader strips only `diffusion_model.`, so it takes
    # --lora_format comfyui (docs/ernie_image.md)
    lora_default_format="diffusers",
    options=ErnieImageOptions,
    description="ERNIE-Image (diffusers ErnieImageTransformer2DModel, Ministral-3 3B, FLUX.2 AE)",
)

__all__ = ["ErnieImagePipeline", "FAMILY"]
