"""The Qwen-Image family (text-to-image and Qwen-Image-Edit): its spec, registered by name."""

from ...core.family import FamilySpec, TokenizerSpec
from ...models.load import load_tokenizer
from ...util import names
from .components import DIT, LORA_TARGET_MODULES, TEXT_ENCODER, VAE
from .control_inputs import ControlNetInput
from .controlnet import BLOCKWISE_CONTROLNET
from .pipeline import QwenImagePipeline
from .processor import load_processor


def _wants_edit(args) -> bool:
    return "edit_image" in names(getattr(args, "extra_inputs", None)) or bool(getattr(args, "edit_image", None))


FAMILY = FamilySpec(
    name="qwen_image",
    pipeline=QwenImagePipeline,
    components=(DIT, TEXT_ENCODER, VAE, BLOCKWISE_CONTROLNET),
    tokenizers=(
        TokenizerSpec(attr="tokenizer", slot="text_encoder", folder="tokenizer", load=load_tokenizer,
                      flag="tokenizer_path"),
        # Qwen-Image-Edit's processor: a processor/ folder beside the text encoder, else (for edit data) the
        # reference's default, Qwen/Qwen-Image-Edit:processor/ (Qwen/Qwen-Image has none).
        TokenizerSpec(attr="processor", slot="text_encoder", folder="processor", load=load_processor,
                      flag="processor_path", default="Qwen/Qwen-Image-Edit:processor/", required=False,
                      needed=_wants_edit),
    ),
    lora_prefixes={"dit": "transformer", "text_encoder": "text_encoder"},
    lora_target_modules=LORA_TARGET_MODULES,
    data="image",
    flag_settings=lambda args: {"edit_image_auto_resize": bool(getattr(args, "edit_image_auto_resize", True)),
                                "zero_cond_t": bool(getattr(args, "zero_cond_t", False))},
    sample_defaults={"height": 1328, "width": 1328, "num_inference_steps": 30, "cfg_scale": 4.0},
    description="Qwen-Image, Qwen-Image-Edit (diffusers QwenImageTransformer2DModel, Qwen2.5-VL, Qwen-Image VAE)",
)

__all__ = ["FAMILY", "ControlNetInput", "QwenImagePipeline"]
