"""The Wan video family (Wan2.1 T2V / I2V, Wan2.2 A14B experts, TI2V-5B; diffusers and Wan-AI's layouts): its spec,
found by the family scan."""

import re
from dataclasses import dataclass

from ...core.family import FamilySpec, TokenizerSpec, text_tokenizer
from ...core.options import SWITCH, option
from .components import (DIT, DIT_ORIGINAL, IMAGE_ENCODER, IMAGE_ENCODER_ORIGINAL, IMAGE_ENCODER_PROJ,
                         LORA_TARGET_MODULES, REFERENCE_LORA_TARGETS, TEXT_ENCODER, TEXT_ENCODER_ORIGINAL, VAE,
                         VAE22_ORIGINAL, VAE_ORIGINAL, load_repo_scheduler)
from .dit_keys import expert_boundary
from .lora_names import ORIGINAL_MODULE_NAMES, convert_original_wan_lora, wan_native_names
from .pipeline import WanVideoPipeline
# the variants (docs/wan.md): their models, their released files' layouts, their pipeline classes
from .animate import ANIMATE_ADAPTER_ORIGINAL, ANIMATE_DIT_ORIGINAL, animate_adapter_to_original
from .animate2 import ANIMATE2_ORIGINAL, WanAnimate2Pipeline, animate2_to_original
from .fun_control import FUN_DIT_ORIGINAL
from .vace import VACE_DIT_ORIGINAL, VACE_LORA_TARGETS, VACE_ORIGINAL, vace_to_original
from .dancer import DANCER_DIT, DANCER_MODULE_PREFIXES, WanDancerPipeline, dancer_to_original
from .longcat import LONGCAT_DIT, WanLongCatPipeline
from .s2v import AUDIO_ENCODER, AUDIO_PROCESSOR, S2V_DIT, WanS2VPipeline
from .vap import VAP, VAP_DIT, WanVAPPipeline


def load_image_processor(path_or_config):
    """CLIP's image processor from an image_processor/ folder; None where a hub repository has none (Wan-AI's
    original repositories: the I2V unit then uses the official settings, `official_clip_processor`)."""
    from transformers import CLIPImageProcessor

    from ...errors import UserError
    from ...models import ModelConfig
    from ...models.load import model_directory
    from ...util import first_line

    if isinstance(path_or_config, ModelConfig) and path_or_config.model_id:
        try:
            path_or_config.resolve()
        except UserError:
            return None
    path = model_directory(path_or_config, "image processor")
    try:
        return CLIPImageProcessor.from_pretrained(str(path))
    except Exception as err:
        raise UserError(f"{path}: cannot load the CLIP image processor ({first_line(err)})") from err


def dit_native_keys(state: dict) -> dict:
    """--full_format original for every Wan DiT: S2V's and LongCat's are in their released names already, the
    Dancer's base goes to Wan-AI's names with its own modules as they are, the rest through Wan's map."""
    from .dit_keys import dit_to_original

    if any(k.startswith(("casual_audio_encoder.", "x_embedder.")) for k in state):
        return dict(state)
    if any(k.startswith(DANCER_MODULE_PREFIXES) for k in state):
        return dancer_to_original(state)
    return dit_to_original(state)


def dit_keys_to_original(state: dict) -> dict:
    """A trained DiT's keys in its released names: Wan-AI's, Wan2.2-Animate-2's (blocks.N.block.self_attn.q), or
    those of the variants with DiTs of their own (S2V, Wan-Dancer, LongCat-Video)."""
    animate2 = any(re.match(r"blocks\.\d+\.(self_attn|cross_attn)\.", k) for k in state)
    return animate2_to_original(state) if animate2 else dit_native_keys(state)


GROUP = "Wan"
# the reference's names on the Wan DiT: q, k, v, o, ffn.0, ffn.2 and the qualified ones (self_attn.q, ...); the
# Wan2.2-Animate-2 pipeline class has its own (its DiT names its modules otherwise)
DIT_LORA_TARGETS = {**ORIGINAL_MODULE_NAMES, **REFERENCE_LORA_TARGETS}


@dataclass(frozen=True)
class WanOptions:
    audio_processor_path: str | None = option(None, "Wan2.2-S2V's wav2vec2 audio processor: a directory or "
                                              "model_id:folder/ (default: wav2vec2-large-xlsr-53-english/ beside "
                                              "the audio encoder).", group=GROUP)
    framewise_decoding: bool = option(False, "Wan-Dancer's global model: clips of any frame count (each frame its "
                                      "own latent frame, for rows whose framewise_decoding is true).", kind=SWITCH,
                                      group=GROUP)

    def time_division(self):
        """--framewise_decoding: clips keep every frame they have (the reference's loader then cuts to 1k+0)."""
        return (1, 0) if self.framewise_decoding else None


FAMILY = FamilySpec(
    name="wan",
    pipeline=WanVideoPipeline,
    components=(DIT, TEXT_ENCODER, VAE, IMAGE_ENCODER, IMAGE_ENCODER_PROJ,
                # variants with DiTs of their own, before Wan-AI's layout (whose markers their files share)
                S2V_DIT, DANCER_DIT, LONGCAT_DIT, VAP_DIT, AUDIO_ENCODER, VAP,
                DIT_ORIGINAL, TEXT_ENCODER_ORIGINAL, VAE22_ORIGINAL, VAE_ORIGINAL, IMAGE_ENCODER_ORIGINAL,
                # the variants' models; a VACE / Animate-14B file holds the DiT and a companion model
                FUN_DIT_ORIGINAL, VACE_DIT_ORIGINAL, VACE_ORIGINAL, ANIMATE_DIT_ORIGINAL, ANIMATE_ADAPTER_ORIGINAL,
                ANIMATE2_ORIGINAL),
    tokenizers=(
        text_tokenizer("tokenizer_path", "Wan-AI/Wan2.1-T2V-1.3B:google/umt5-xxl/",
                       help="The UMT5 tokenizer: a directory or model_id:folder/ (default: tokenizer/ beside the text "
                            "encoder, else Wan-AI/Wan2.1-T2V-1.3B's)."),
        # an image_processor/ folder beside the CLIP (diffusers layout); none beside Wan-AI's original .pth:
        # the official settings (units.official_clip_processor)
        TokenizerSpec(attr="image_processor", slot="image_encoder", folder="image_processor",
                      load=load_image_processor, required=False),
        # the repository's sampling scheduler (diffusers layout), beside the DiT; none for bare files
        TokenizerSpec(attr="repo_scheduler", slot="dit", folder="scheduler", load=load_repo_scheduler,
                      required=False, download=False),
        AUDIO_PROCESSOR,  # Wan2.2-S2V's wav2vec2 feature extractor (--audio_processor_path)
    ),
    # VACE's branch and Animate's adapter are modules of diffusers' one transformer (WanVACETransformer3DModel,
    # WanAnimateTransformer3DModel), so their LoRAs are keyed under `transformer.` as the DiT's
    lora_prefixes={"dit": "transformer", "dit2": "transformer_2",
                   "vace": "transformer", "vace2": "transformer_2", "animate_adapter": "transformer"},
    lora_target_modules=LORA_TARGET_MODULES,
    lora_target_aliases={"dit": DIT_LORA_TARGETS, "dit2": DIT_LORA_TARGETS, "vace": VACE_LORA_TARGETS,
                         "vace2": VACE_LORA_TARGETS},
    lora_converters=(convert_original_wan_lora,),
    lora_native_names=wan_native_names,
    # diffusion_model.<Wan's module names> + .alpha: diffusers, ComfyUI and DiffSynth-Studio all read it
    lora_default_format="comfyui",
    full_native_keys={"dit": dit_keys_to_original, "vace": vace_to_original,
                      "animate_adapter": animate_adapter_to_original},
    experts=("dit", "dit2"),
    expert_boundary=expert_boundary,
    options=WanOptions,
    variants=(WanAnimate2Pipeline, WanS2VPipeline, WanDancerPipeline, WanLongCatPipeline, WanVAPPipeline),
    description="Wan2.1 / Wan2.2 video (diffusers WanTransformer3DModel, AutoencoderKLWan, UMT5, CLIP vision)",
)

__all__ = ["FAMILY", "WanAnimate2Pipeline", "WanDancerPipeline", "WanLongCatPipeline", "WanS2VPipeline",
           "WanVAPPipeline", "WanVideoPipeline"]
