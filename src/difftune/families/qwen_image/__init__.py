"""The Qwen-Image family (text-to-image, Qwen-Image-Edit and Edit-Plus, In-Context control, Blockwise ControlNet,
EliGen; Qwen-Image-Layered as its own pipeline class): its spec, found by the family scan."""

from dataclasses import dataclass

from ...core.family import FamilySpec, TokenizerSpec, text_tokenizer
from ...core.options import BOOL, SWITCH, option
from ...parts.qwen_vl import load_processor
from .components import DIT, LORA_TARGET_MODULES, TEXT_ENCODER, VAE
from .controlnet import BLOCKWISE_CONTROLNET, ControlNetInput
from .layered import QwenImageLayeredPipeline
from .pipeline import QwenImagePipeline

GROUP = "Qwen-Image"


@dataclass(frozen=True)
class QwenImageOptions:
    zero_cond_t: bool = option(False, "Qwen-Image-Edit-2511: the edit images' tokens are modulated at t=0 (on "
                               "anyway when the transformer's config.json says so).", kind=SWITCH, group=GROUP)
    edit_image_auto_resize: bool = option(True, "Qwen-Image-Edit: resize edit images to about 1 MP (default true, "
                                          "as the reference).", kind=BOOL, group=GROUP)


FAMILY = FamilySpec(
    name="qwen_image",
    pipeline=QwenImagePipeline,
    variants=(QwenImageLayeredPipeline,),
    components=(DIT, TEXT_ENCODER, VAE, BLOCKWISE_CONTROLNET),
    tokenizers=(
        text_tokenizer("tokenizer_path"),
        # Qwen-Image-Edit's processor: a processor/ folder beside the text encoder, else (for edit data) the
        # reference's default, Qwen/Qwen-Image-Edit:processor/ (Qwen/Qwen-Image has none).
        TokenizerSpec(attr="processor", slot="text_encoder", folder="processor", load=load_processor,
                      flag="processor_path", default="Qwen/Qwen-Image-Edit:processor/", required=False,
                      feature="edit", help="Image processor directory (Qwen-Image-Edit; default: processor/ beside "
                                           "the text encoder, else Qwen/Qwen-Image-Edit:processor/)."),
    ),
    lora_target_modules=LORA_TARGET_MODULES,
    # diffusion_model.<module> + .alpha: diffusers, ComfyUI and DiffSynth-Studio all read it (docs/lora_files.md)
    lora_default_format="comfyui",
    options=QwenImageOptions,
    unit_settings=lambda options: {"edit_image_auto_resize": bool(options.edit_image_auto_resize),
                                   "zero_cond_t": bool(options.zero_cond_t)},
    description="Qwen-Image, Qwen-Image-Edit (diffusers QwenImageTransformer2DModel, Qwen2.5-VL, Qwen-Image VAE)",
)

__all__ = ["FAMILY", "ControlNetInput", "QwenImageLayeredPipeline", "QwenImagePipeline"]
