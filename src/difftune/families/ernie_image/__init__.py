"""The ERNIE-Image family (PaddlePaddle/ERNIE-Image): its spec, found by the family scan."""

from ...core.family import FamilySpec, text_tokenizer
from .components import COMPONENTS, LORA_TARGET_MODULES
from .pipeline import ErnieImagePipeline


FAMILY = FamilySpec(
    name="ernie_image",
    pipeline=ErnieImagePipeline,
    components=COMPONENTS,
    tokenizers=(text_tokenizer("tokenizer_path", "PaddlePaddle/ERNIE-Image:tokenizer/"),),
    lora_target_modules=LORA_TARGET_MODULES,
    # the reference's DiT has diffusers' module names, so no renaming either way
    lora_native_names=None,
    # diffusers' ErnieImageLoraLoaderMixin refuses files holding `.alpha` tensors, so the default is diffusers'
    # layout (alpha folded into B); the reference's loader strips only `diffusion_model.`, so it takes
    # --lora_format comfyui (docs/ernie_image.md)
    lora_default_format="diffusers",
    description="ERNIE-Image (diffusers ErnieImageTransformer2DModel, Ministral-3 3B, FLUX.2 AE)",
)

__all__ = ["ErnieImagePipeline", "FAMILY"]
