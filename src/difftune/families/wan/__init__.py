"""The Wan video family (Wan2.1 T2V / I2V, Wan2.2 A14B experts, TI2V-5B; diffusers layout): its spec."""

from ...core.family import FamilySpec, TokenizerSpec
from ...models.load import load_tokenizer
from .components import (DIT, DIT_ORIGINAL, IMAGE_ENCODER, IMAGE_ENCODER_ORIGINAL, IMAGE_ENCODER_PROJ,
                         LORA_TARGET_MODULES, REFERENCE_LORA_TARGETS, TEXT_ENCODER, TEXT_ENCODER_ORIGINAL, VAE,
                         VAE22_ORIGINAL, VAE_ORIGINAL, load_repo_scheduler)
from .dit_keys import dit_to_original, expert_boundary
from .lora_names import convert_original_wan_lora, wan_native_names
from .pipeline import WanVideoPipeline


def load_image_processor(path_or_config):
    """CLIP's image processor from an image_processor/ folder; None where a hub repository has none (Wan-AI's
    original repositories: the I2V unit then uses the official settings, `official_clip_processor`)."""
    from transformers import CLIPImageProcessor

    from ...errors import UserError
    from ...models import ModelConfig
    from ...models.load import _directory
    from ...util import first_line

    if isinstance(path_or_config, ModelConfig) and path_or_config.model_id:
        try:
            path_or_config.resolve()
        except UserError:
            return None
    path = _directory(path_or_config, "image processor")
    try:
        return CLIPImageProcessor.from_pretrained(str(path))
    except Exception as err:
        raise UserError(f"{path}: cannot load the CLIP image processor ({first_line(err)})") from err


FAMILY = FamilySpec(
    name="wan",
    pipeline=WanVideoPipeline,
    components=(DIT, TEXT_ENCODER, VAE, IMAGE_ENCODER, IMAGE_ENCODER_PROJ, DIT_ORIGINAL, TEXT_ENCODER_ORIGINAL,
                VAE22_ORIGINAL, VAE_ORIGINAL, IMAGE_ENCODER_ORIGINAL),
    tokenizers=(
        TokenizerSpec(attr="tokenizer", slot="text_encoder", folder="tokenizer", load=load_tokenizer,
                      flag="tokenizer_path", default="Wan-AI/Wan2.1-T2V-1.3B:google/umt5-xxl/"),
        # an image_processor/ folder beside the CLIP (diffusers layout); none beside Wan-AI's original .pth:
        # the official settings (units.official_clip_processor)
        TokenizerSpec(attr="image_processor", slot="image_encoder", folder="image_processor",
                      load=load_image_processor, required=False),
        # the repository's sampling scheduler (diffusers layout), beside the DiT; none for bare files
        TokenizerSpec(attr="repo_scheduler", slot="dit", folder="scheduler", load=load_repo_scheduler,
                      required=False, needed=lambda args: False),
    ),
    lora_prefixes={"dit": "transformer", "dit2": "transformer_2", "text_encoder": "text_encoder"},
    lora_target_modules=LORA_TARGET_MODULES,
    lora_target_aliases={"dit": REFERENCE_LORA_TARGETS, "dit2": REFERENCE_LORA_TARGETS},
    lora_converters=(convert_original_wan_lora,),
    lora_native_names=wan_native_names,
    full_native_keys={"dit": dit_to_original},
    experts=("dit", "dit2"),
    expert_boundary=expert_boundary,
    data="video",  # clips (a still image is a one-frame clip); input_image / end_image from their frames
    sample_defaults={"height": 480, "width": 832, "num_inference_steps": 50, "cfg_scale": 5.0},
    description="Wan2.1 / Wan2.2 video (diffusers WanTransformer3DModel, AutoencoderKLWan, UMT5, CLIP vision)",
)

__all__ = ["FAMILY", "WanVideoPipeline"]
