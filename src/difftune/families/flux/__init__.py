"""The FLUX.1 family (FLUX.1-dev / -schnell / Krea / Kontext / Fill, Redux, ControlNets, IP-Adapter, InfiniteYou,
EliGen, FLEX.2, AttriCtrl, LoRA-Encoder, Nexus-Gen, Insert-Anything; Step1X-Edit as its own pipeline class): its
spec, found by the family scan."""

from dataclasses import dataclass

from ...core.family import FamilySpec, TokenizerSpec
from ...core.options import SWITCH, option
from ...models.load import load_tokenizer
from .components import (DIT, DIT_BFL, FUSED_LORA_TARGETS, LORA_TARGET_MODULES, REFERENCE_LORA_TARGETS, TEXT_ENCODER,
                         TEXT_ENCODER_2, VAE, VAE_BFL)
from .bfl import bfl_lora_from_diffusers, convert_bfl_named_flux_lora, flux_lora_export_notes
from .controlnet import CONTROLNET, ControlNetInput
from .infiniteyou import IMAGE_PROJ_MODEL, image_proj_native_keys
from .insert_anything import SIZE as INSERT_ANYTHING_SIZE
from .ipadapter import IPADAPTER, IPADAPTER_IMAGE_ENCODER, ipadapter_native_keys
from .lora_encoder import LORA_ENCODER, lora_encoder_native_keys
from .nexus_gen import NEXUS_AR, NEXUS_DIT, NEXUS_MERGER, load_nexus_processor
from .pipeline import FluxImagePipeline
from .redux import REDUX_IMAGE_EMBEDDER, REDUX_IMAGE_ENCODER
from .step1x import QWENVL, STEP1X_CONNECTOR, STEP1X_DIT, Step1XEditPipeline, load_step1x_processor
from .value_control import VALUE_CONTROLLER

GROUP = "FLUX.1"


@dataclass(frozen=True)
class FluxOptions:
    align_to_opensource_format: bool = option(False, "The reference's FLUX flag: write the LoRA in the kohya layout "
                                              "(lora_unet_double_blocks_*, lora_down/lora_up, an alpha per layer), "
                                              "as it does; the same as --lora_format kohya.", kind=SWITCH,
                                              group=GROUP)
    insert_anything_size: int = option(INSERT_ANYTHING_SIZE, "Insert-Anything: the side of each half of the diptych "
                                       "it trains on and samples (the reference's fixed 768).", kind=int,
                                       group=GROUP, sample=True)

    def __post_init__(self):
        if self.insert_anything_size < 16 or self.insert_anything_size % 16:
            from ...errors import UserError

            raise UserError(f"--insert_anything_size {self.insert_anything_size}: a multiple of 16 is needed")

    def lora_format(self) -> tuple[str, str] | None:
        """(the LoRA layout these flags ask for, the flag), or None: --lora_format decides."""
        return ("kohya", "--align_to_opensource_format") if self.align_to_opensource_format else None


FAMILY = FamilySpec(
    name="flux",
    pipeline=FluxImagePipeline,
    variants=(Step1XEditPipeline,),
    # Order matters where two specs fit one file: the plain DiT before a variant's; Redux's SigLIP (vision tower
    # only, with a config.json of its class) before the IP-Adapter's (the whole SigLIP).
    components=(DIT, TEXT_ENCODER, TEXT_ENCODER_2, VAE, DIT_BFL, VAE_BFL, STEP1X_DIT, STEP1X_CONNECTOR, NEXUS_DIT,
                NEXUS_MERGER, NEXUS_AR, QWENVL, CONTROLNET, REDUX_IMAGE_ENCODER, REDUX_IMAGE_EMBEDDER, IPADAPTER,
                IPADAPTER_IMAGE_ENCODER, IMAGE_PROJ_MODEL, VALUE_CONTROLLER, LORA_ENCODER),
    tokenizers=(
        TokenizerSpec(attr="tokenizer_1", slot="text_encoder", folder="tokenizer", load=load_tokenizer,
                      flag="tokenizer_1_path", help="The CLIP tokenizer: a directory or model_id:folder/ (default: "
                                                    "tokenizer/ beside the CLIP text encoder)."),
        TokenizerSpec(attr="tokenizer_2", slot="text_encoder_2", folder="tokenizer_2", load=load_tokenizer,
                      flag="tokenizer_2_path", help="The T5 tokenizer: a directory or model_id:folder/ (default: "
                                                    "tokenizer_2/ beside the T5 encoder)."),
        TokenizerSpec(attr="nexus_gen_processor", slot="nexus_gen", folder="processor", load=load_nexus_processor,
                      flag="nexus_gen_processor_path", help="Nexus-Gen: the Qwen2.5-VL processor (default: "
                                                            "processor/ of the Nexus-GenV2 repository)."),
        TokenizerSpec(attr="step1x_processor", slot="qwenvl", folder="", load=load_step1x_processor,
                      flag="step1x_processor_path", help="Step1X-Edit: the Qwen2.5-VL processor (default: the "
                                                         "Qwen2.5-VL weights' own folder)."),
    ),
    lora_target_modules=LORA_TARGET_MODULES,
    # The reference's `proj_out` reaches its single blocks' output layers only (its final layer is `final_proj_out`);
    # diffusers calls both `proj_out`, so the name keeps the reference's meaning here.
    lora_target_aliases={"dit": {**REFERENCE_LORA_TARGETS, "proj_out": "single_transformer_blocks.*.proj_out"}},
    # its a_to_qkv, b_to_qkv, to_qkv_mlp: one adapter each, as the reference trains its fused layers
    lora_fused_aliases={"dit": FUSED_LORA_TARGETS},
    lora_converters=(convert_bfl_named_flux_lora,),
    lora_native_names=bfl_lora_from_diffusers,
    lora_export_notes=flux_lora_export_notes,
    # --full_format original: the add-on models in their released files' names
    full_native_keys={"ipadapter": ipadapter_native_keys, "image_proj_model": image_proj_native_keys,
                      "lora_encoder": lora_encoder_native_keys},
    options=FluxOptions,
    unit_settings=lambda options: {"insert_anything_size": int(options.insert_anything_size)},
    description="FLUX.1 (diffusers FluxTransformer2DModel, AutoencoderKL, CLIP-L, T5-XXL) and its variants",
)

__all__ = ["ControlNetInput", "FAMILY", "FluxImagePipeline", "Step1XEditPipeline"]
