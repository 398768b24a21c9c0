"""The ACE-Step 1.5 family (text-to-music: the turbo, base, sft, turbo-shift and XL DiTs): its spec, found by the
family scan."""

import os
from dataclasses import dataclass
from pathlib import Path

from ...core.family import FamilySpec, TokenizerSpec, text_tokenizer
from ...core.options import option
from ...errors import UserError
from .components import COMPONENTS, LORA_TARGET_MODULES, REFERENCE_LORA_TARGETS, original_dit_keys
from .lora import ace_step_lora_native_names, ace_step_lora_reference_names, convert_original_ace_step_lora
from .pipeline import AceStepPipeline

GROUP = "ACE-Step"
SILENCE_FILE = "silence_latent.pt"
SILENCE_DEFAULT = "ACE-Step/Ace-Step1.5:acestep-v15-turbo/silence_latent.pt"


@dataclass(frozen=True)
class AceStepOptions:
    max_audio_duration: float | None = option(
        None, "Seconds of each clip trained on: longer clips are cut to it (with a note); default: whole clips.",
        kind=float, group=GROUP)
    silence_latent_path: str | None = option(
        None, f"The silence latent (one tensor: silence_latent.pt, read with weights_only) as a file or "
        f"model_id:path (default: beside the DiT's weights, else {SILENCE_DEFAULT}).", group=GROUP, sample=True)

    def __post_init__(self):
        most = self.max_audio_duration
        if most is not None and not float(most) > 0:
            raise UserError(f"--max_audio_duration {most}: must be a positive number of seconds")


def load_silence_latent(where):
    """The silence latent, (1, frames, 64) (the release stores (1, 64, frames): transposed as the reference does)."""
    from ...models import ModelConfig
    from ...models.files import load_tensor

    found = where.resolve() if isinstance(where, ModelConfig) else os.fspath(where)
    if isinstance(found, (list, tuple)):
        found = next((f for f in found if os.path.basename(f) == SILENCE_FILE), found[0])
    path = Path(found)
    if path.is_dir():
        path = path / SILENCE_FILE
        if not path.is_file():
            raise UserError(f"{path.parent}: no {SILENCE_FILE} beside the DiT's weights: pass --silence_latent_path "
                            f"(e.g. {SILENCE_DEFAULT})")
    latent = load_tensor(path)
    if latent.dim() != 3 or latent.shape[0] != 1:
        raise UserError(f"{path}: a silence latent is (1, channels, frames), this tensor is {tuple(latent.shape)}")
    return latent.transpose(1, 2).contiguous()


FAMILY = FamilySpec(
    name="ace_step",
    pipeline=AceStepPipeline,
    components=COMPONENTS,
    tokenizers=(
        # the tokenizer sits in the text encoder's own folder (Qwen3-Embedding-0.6B/)
        text_tokenizer("tokenizer_path", "ACE-Step/Ace-Step1.5:Qwen3-Embedding-0.6B/", folder=""),
        # stage 1 reads it (the context and the timbre of silence), beside the DiT file the condition encoder is in
        TokenizerSpec(attr="silence_latent", slot="conditioner", folder="", load=load_silence_latent,
                      flag="silence_latent_path", default=SILENCE_DEFAULT),
    ),
    lora_target_modules=LORA_TARGET_MODULES,
    lora_target_aliases={"dit": REFERENCE_LORA_TARGETS},
    lora_converters=(convert_original_ace_step_lora,),
    lora_native_names=ace_step_lora_native_names,
    lora_reference_names=ace_step_lora_reference_names,
    # no one file is read by all three (docs/ace_step.md): diffusers' layout is read whole by diffusers; the
    # reference's loader takes --lora_format reference, ComfyUI --lora_format comfyui
    lora_default_format="diffusers",
    full_native_keys={"dit": original_dit_keys},
    options=AceStepOptions,
    repositories=("ACE-Step/",),
    description="ACE-Step 1.5 text-to-music (diffusers AceStepTransformer1DModel, AceStepConditionEncoder, "
                "Qwen3-Embedding-0.6B, Oobleck VAE)",
)

__all__ = ["AceStepPipeline", "FAMILY"]
