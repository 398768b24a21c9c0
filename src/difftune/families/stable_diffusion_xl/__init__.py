"""The Stable Diffusion XL family (stable-diffusion-xl-base-1.0 and its fine-tunes): its spec, found by the family
scan."""

from dataclasses import dataclass

from ...core.family import FamilySpec, TokenizerSpec, text_tokenizer
from ...core.options import SWITCH, option
from ...errors import UserError
from ...models.load import load_tokenizer
from .components import COMPONENTS, LORA_TARGET_MODULES
from .lora_names import kohya_from_ldm, ldm_names
from .pipeline import VARIANTS, StableDiffusionXLPipeline

REPO = "stabilityai/stable-diffusion-xl-base-1.0"
GROUP = "SDXL"


@dataclass(frozen=True)
class SDXLOptions:
    align_to_opensource_format: bool = option(False, "The reference's SDXL flag: write the LoRA in kohya's layout "
                                              "with the original (LDM) UNet names (lora_unet_input_blocks_4_1_..., "
                                              "lora_down/lora_up, an alpha per layer), as A1111, Forge and ComfyUI "
                                              "read; the same as --lora_format kohya.", kind=SWITCH, group=GROUP)
    v_parameterization: bool = option(False, "The base predicts the velocity (v-prediction: SD 2.x 768-v, NoobAI-XL "
                                      "v-pred): train and sample it so (kohya's --v_parameterization).", kind=SWITCH,
                                      group=GROUP, sample=True)
    zero_terminal_snr: bool = option(False, "With --v_parameterization: the schedule rescaled to zero SNR at its last "
                                     "step, sampled from there (kohya's --zero_terminal_snr).", kind=SWITCH,
                                     group=GROUP, sample=True)

    def __post_init__(self):
        if self.zero_terminal_snr and not self.v_parameterization:
            raise UserError("--zero_terminal_snr needs --v_parameterization: at zero SNR the noise is the input "
                            "itself, which an epsilon-predicting model cannot learn")

    def lora_format(self) -> tuple[str, str] | None:
        return ("kohya", "--align_to_opensource_format") if self.align_to_opensource_format else None


FAMILY = FamilySpec(
    name="stable_diffusion_xl",
    pipeline=StableDiffusionXLPipeline,
    variants=VARIANTS,
    components=COMPONENTS,
    options=SDXLOptions,
    tokenizers=(
        text_tokenizer("tokenizer_path", f"{REPO}:tokenizer/"),
        TokenizerSpec(attr="tokenizer_2", slot="text_encoder_2", folder="tokenizer_2", load=load_tokenizer,
                      flag="tokenizer_2_path", default=f"{REPO}:tokenizer_2/",
                      help="The bigG tokenizer: a directory or model_id:folder/ (default: tokenizer_2/ beside the "
                           "second text encoder)."),
    ),
    lora_prefixes={"unet": "unet", "text_encoder": "text_encoder", "text_encoder_2": "text_encoder_2"},
    lora_target_modules=LORA_TARGET_MODULES,
    # kohya's layout in the original UNet names: what A1111, Forge, ComfyUI and diffusers read for SDXL
    lora_default_format="kohya",
    kohya_model_version="sdxl_base_v1-0",
    lora_native_names=ldm_names,
    lora_converters=(kohya_from_ldm,),
    repositories=(REPO,),
    description="Stable Diffusion XL (diffusers UNet2DConditionModel, CLIP-L + bigG, KL-f8 VAE; epsilon prediction)",
)

__all__ = ["FAMILY", "StableDiffusionXLPipeline"]
