"""The Wan video family (Wan2.1 T2V / I2V, Wan2.2 A14B experts, TI2V-5B; diffusers and Wan-AI's layouts): its spec,
found by the family scan."""

from dataclasses import dataclass

from ...core.family import FamilySpec, TokenizerSpec
from ...core.options import SWITCH, option
from ...models.load import load_tokenizer
from .components import (DIT, DIT_ORIGINAL, IMAGE_ENCODER, IMAGE_ENCODER_ORIGINAL, IMAGE_ENCODER_PROJ,
                         LORA_TARGET_MODULES, REFERENCE_LORA_TARGETS, TEXT_ENCODER, TEXT_ENCODER_ORIGINAL, VAE,
                         VAE22_ORIGINAL, VAE_ORIGINAL, load_repo_scheduler)
from .dit_keys import expert_boundary
from .lora_names import convert_original_wan_lora, wan_native_names
from .dancer import DANCER_DIT, WanDancerPipeline
from .longcat import LONGCAT_DIT, WanLongCatPipeline
from .pipeline import WanVideoPipeline
from .s2v import AUDIO_ENCODER, AUDIO_PROCESSOR, S2V_DIT, WanS2VPipeline
from .variant import dit_native_keys
from .vap import VAP, VAP_DIT, WanVAPPipeline


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


GROUP = "Wan"


@dataclass(frozen=True)
class WanOptions:
    tokenizer_path: str | None = option(None, "The UMT5 tokenizer: a directory or model_id:folder/ (default: "
                                        "tokenizer/ beside the text encoder, else Wan-AI/Wan2.1-T2V-1.3B's).",
                                        group=GROUP, sample=True)
    audio_processor_path: str | None = option(None, "Wan2.2-S2V's wav2vec2 audio processor: a directory or "
                                              "model_id:folder/ (default: wav2vec2-large-xlsr-53-english/ beside "
                                              "the audio encoder).", group=GROUP)
    framewise_decoding: bool = option(False, "Wan-Dancer's global model: clips of any frame count (each frame its "
                                      "own latent frame, for rows whose framewise_decoding is true).", kind=SWITCH,
                                      group=GROUP)
    # difftune sample's inputs
    end_image: str | None = option(None, "Wan I2V / FLF2V: the last frame.", load="RGB", group=GROUP, sample=True,
                                   train=False)

    def time_division(self):
        """--framewise_decoding: clips keep every frame they have (the reference's loader then cuts to 1k+0)."""
        return (1, 0) if self.framewise_decoding else None


FAMILY = FamilySpec(
    name="wan",
    pipeline=WanVideoPipeline,
    components=(DIT, TEXT_ENCODER, VAE, IMAGE_ENCODER, IMAGE_ENCODER_PROJ,
                # variants with DiTs of their own, before Wan-AI's layout (whose markers their files share)
                S2V_DIT, DANCER_DIT, LONGCAT_DIT, VAP_DIT, AUDIO_ENCODER, VAP,
                DIT_ORIGINAL, TEXT_ENCODER_ORIGINAL, VAE22_ORIGINAL, VAE_ORIGINAL, IMAGE_ENCODER_ORIGINAL),
    tokenizers=(
        TokenizerSpec(attr="tokenizer", slot="text_encoder", folder="tokenizer", load=load_tokenizer,
                      flag="tokenizer_path", default="Wan-AI/Wan2.1-T2V-1.3B:google/umt5-xxl/"),
        # an image_processor/ folder beside the CLIP (diffusers layout); none beside Wan-AI's original .pth:
        # the official settings (units.official_clip_processor)
        TokenizerSpec(attr="image_processor", slot="image_encoder", folder="image_processor",
                      load=load_image_processor, required=False),
        # the repository's sampling scheduler (diffusers layout), beside the DiT; none for bare files
        TokenizerSpec(attr="repo_scheduler", slot="dit", folder="scheduler", load=load_repo_scheduler,
                      required=False, download=False),
        AUDIO_PROCESSOR,  # Wan2.2-S2V's wav2vec2 feature extractor (--audio_processor_path)
    ),
    lora_prefixes={"dit": "transformer", "dit2": "transformer_2", "text_encoder": "text_encoder"},
    lora_target_modules=LORA_TARGET_MODULES,
    lora_target_aliases={"dit": REFERENCE_LORA_TARGETS, "dit2": REFERENCE_LORA_TARGETS},
    lora_converters=(convert_original_wan_lora,),
    lora_native_names=wan_native_names,
    full_native_keys={"dit": dit_native_keys},
    variants=(WanS2VPipeline, WanDancerPipeline, WanLongCatPipeline, WanVAPPipeline),
    experts=("dit", "dit2"),
    expert_boundary=expert_boundary,
    data="video",  # clips (a still image is a one-frame clip); input_image / end_image from their frames
    options=WanOptions,
    description="Wan2.1 / Wan2.2 video (diffusers WanTransformer3DModel, AutoencoderKLWan, UMT5, CLIP vision)",
)

__all__ = ["FAMILY", "WanDancerPipeline", "WanLongCatPipeline", "WanS2VPipeline", "WanVAPPipeline",
           "WanVideoPipeline"]
