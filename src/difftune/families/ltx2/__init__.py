"""The LTX-2 family (LTX-2 19B, LTX-2.3 22B and JoyAI-Echo: text- and image-to-video with its sound, in-context
IC-LoRA): its spec, found by the family scan."""

from dataclasses import dataclass

from ...core.family import FamilySpec, text_tokenizer
from ...core.options import option
from ...errors import UserError
from .components import COMPONENTS, LORA_TARGET_MODULES
from .lora import convert_official_lora, official_lora_names, reference_lora_names
from .loss import LOSSES
from .pipeline import DEFAULT_FRAME_RATE, LTX2Pipeline

GROUP = "LTX-2"
GEMMA = "google/gemma-3-12b-it-qat-q4_0-unquantized:"


@dataclass(frozen=True)
class LTX2Options:
    frame_rate: float = option(
        DEFAULT_FRAME_RATE, "Frames per second the clips are resampled to (by their timestamps) and trained at, and "
        "the rate their sound is timed by; a metadata column frame_rate (--extra_inputs) tells the DiT another "
        "rate per clip. difftune sample: the clip's rate (its positions and its sound's length), and the rate the "
        "mp4 plays at unless --fps says.", kind=float, group=GROUP, sample=True)

    def __post_init__(self):
        if not float(self.frame_rate) > 0:
            raise UserError(f"--frame_rate {self.frame_rate}: must be a positive number of frames per second")


FAMILY = FamilySpec(
    name="ltx2",
    pipeline=LTX2Pipeline,
    components=COMPONENTS,
    # the Gemma-3 folder holds its tokenizer (the reference's default --tokenizer_path); a diffusers repository
    # keeps it in tokenizer/ beside text_encoder/
    tokenizers=(text_tokenizer("tokenizer_path", GEMMA, folder="", else_folder="tokenizer"),),
    lora_target_modules=LORA_TARGET_MODULES,
    lora_converters=(convert_official_lora,),
    lora_native_names=official_lora_names,
    lora_reference_names=reference_lora_names,
    # diffusion_model.<official path>, alpha folded: diffusers, the reference and ComfyUI all read it (lora.py)
    lora_default_format="reference",
    losses=LOSSES,
    options=LTX2Options,
    unit_settings=lambda options: {"run_frame_rate": float(options.frame_rate)},
    repositories=("Lightricks/LTX-2", "DiffSynth-Studio/LTX-2", "jd-opensource/JoyAI-Echo"),
    description="LTX-2 / LTX-2.3 / JoyAI-Echo video with sound (diffusers LTX2VideoTransformer3DModel, the LTX-2 "
                "video and audio VAEs, text connectors, vocoder; Gemma-3)",
)

__all__ = ["FAMILY", "LTX2Pipeline"]
