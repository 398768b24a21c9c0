"""The Z-Image family (Z-Image, Z-Image-Turbo, Z-Image-Omni-Base, the Turbo Fun ControlNets): its spec."""

from ...core.family import FamilySpec, TokenizerSpec
from ...models.load import load_tokenizer
from .components import COMPONENTS, LORA_TARGET_MODULES, original_dit_keys
from .pipeline import ZImagePipeline

FAMILY = FamilySpec(
    name="z_image",
    pipeline=ZImagePipeline,
    components=COMPONENTS,
    tokenizers=(
        # the reference's default when a command names none: Z-Image-Turbo's tokenizer/
        TokenizerSpec(attr="tokenizer", slot="text_encoder", folder="tokenizer", load=load_tokenizer,
                      flag="tokenizer_path", default="Tongyi-MAI/Z-Image-Turbo:tokenizer/"),
    ),
    lora_prefixes={"dit": "transformer", "text_encoder": "text_encoder", "controlnet": "controlnet"},
    lora_target_modules=LORA_TARGET_MODULES,
    # --lora_format comfyui: ComfyUI maps Z-Image LoRAs in diffusers' module names (diffusion_model.<path>) onto
    # its fused qkv itself (comfy/lora.py, the Lumina2 branch), so the names are written as they are.
    lora_native_names=None,
    full_native_keys={"dit": original_dit_keys},
    data="image",
    sample_defaults={"height": 1024, "width": 1024, "num_inference_steps": 8, "cfg_scale": 1.0},
    description="Z-Image, Z-Image-Turbo, Z-Image-Omni-Base, Turbo Fun ControlNets (diffusers ZImageTransformer2DModel, "
                "Qwen3, FLUX.1 AE, SigLIP2)",
)

__all__ = ["FAMILY", "ZImagePipeline"]
