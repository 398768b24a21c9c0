"""The Stable Diffusion 1.x family (stable-diffusion-v1-5 and its fine-tunes): its spec, found by the family scan."""

from dataclasses import dataclass

from ...core.family import FamilySpec, text_tokenizer
from ...core.options import SWITCH, option
from ...errors import UserError
from .components import COMPONENTS, LORA_TARGET_MODULES
from .pipeline import VARIANTS, StableDiffusionPipeline

GROUP = "Stable Diffusion 1.x"


@dataclass(frozen=True)
class SDOptions:
    v_parameterization: bool = option(False, "The base predicts the velocity (v-prediction: SD 2.x 768-v, NoobAI-XL "
                                      "v-pred): train and sample it so (kohya's --v_parameterization).", kind=SWITCH,
                                      group=GROUP, sample=True)
    zero_terminal_snr: bool = option(False, "With --v_parameterization: the schedule rescaled to zero SNR at its last "
                                     "step, sampled from there (kohya's --zero_terminal_snr).", kind=SWITCH,
                                     group=GROUP, sample=True)

    clip_skip: int = option(1, "Read CLIP-L's hidden states this many layers from the end (1: the last; 2: the "
                            "second-to-last, the anime models' habit), through its final layer norm (kohya's "
                            "--clip_skip; diffusers' clip_skip is one less).", kind=int, group=GROUP, sample=True)

    def __post_init__(self):
        if self.clip_skip < 1:
            raise UserError(f"--clip_skip {self.clip_skip}: 1 (the last layer) or more is needed")
        if self.zero_terminal_snr and not self.v_parameterization:
            raise UserError("--zero_terminal_snr needs --v_parameterization: at zero SNR the noise is the input "
                            "itself, which an epsilon-predicting model cannot learn")


FAMILY = FamilySpec(
    name="stable_diffusion",
    pipeline=StableDiffusionPipeline,
    variants=VARIANTS,
    components=COMPONENTS,
    options=SDOptions,
    tokenizers=(text_tokenizer("tokenizer_path", "AI-ModelScope/stable-diffusion-v1-5:tokenizer/"),),
    unit_settings=lambda options: {"run_clip_skip": int(options.clip_skip)},
    lora_prefixes={"unet": "unet", "text_encoder": "text_encoder"},
    lora_target_modules=LORA_TARGET_MODULES,
    # kohya's names (lora_unet_<diffusers path>, lora_down / lora_up, alpha): what A1111, Forge, ComfyUI and diffusers
    # all read for SD 1.x (docs/stable_diffusion.md)
    lora_default_format="kohya",
    kohya_model_version="sd_v1",
    repositories=("AI-ModelScope/stable-diffusion-v1-5", "stable-diffusion-v1-5/stable-diffusion-v1-5",
                  "runwayml/stable-diffusion-v1-5"),
    description="Stable Diffusion 1.x (diffusers UNet2DConditionModel, CLIP-L, KL-f8 VAE; epsilon prediction)",
)

__all__ = ["FAMILY", "StableDiffusionPipeline"]
