"""What the Wan variant pipelines with models of their own (S2V, Wan-Dancer, LongCat-Video, Video-As-Prompt: the
sub-packages s2v/, dancer/, longcat/, vap/) share: which runs are theirs (the DiT's class), their data columns handed
to their units as the data set loaded them, stage 1 one sample at a time, and `__call__` with their inputs by name."""

from __future__ import annotations

import json
from typing import Any

from ...errors import UserError
from .pipeline import CALL_DEFAULTS, WanBasePipeline


def dit_class(context) -> str | None:
    """The class name of the run's DiT (its config.json's, or the official config its weights matched)."""
    return (context.config("dit") or {}).get("_class_name")


def as_list(value, name: str, row) -> list | None:
    """A list-valued column: a JSON list, or its text in a CSV cell ("[1, 0, 0]")."""
    if value is None or isinstance(value, list):
        return value
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except json.JSONDecodeError:
            parsed = None
        if isinstance(parsed, list):
            return parsed
    raise UserError(f"row {row}: '{name}' must be a list (a JSON list such as [1, 0, 0]), got {value!r}")


class WanVariantPipeline(WanBasePipeline):
    """A Wan variant with its own models and inputs: `own_inputs` are data columns and `__call__` inputs that
    its units read as they come (clips as frames, audio as waveforms or paths, numbers, lists)."""

    own_inputs: tuple[str, ...] = ()
    # their DiTs keep their released module names, which Wan's comfyui renaming does not know: the default LoRA file
    # keeps diffusers' layout
    lora_default_format = "diffusers"

    def training_inputs(self, data: dict[str, Any]) -> dict[str, Any]:
        values = super().training_inputs(data)
        # as the data set loaded them, but for the features' aligned clips, which `feature_data` cut to the clip
        values.update({name: data.get(name) for name in self.own_inputs if name not in values})
        return values

    @staticmethod
    def batch_signature(sample: dict[str, Any]):
        return None  # per-sample audio, clips and lists: stage 1 encodes one sample at a time

    def __call__(self, prompt: str | list[str], negative_prompt: str | list[str] = "", input_image=None,
                 end_image=None, height: int | None = CALL_DEFAULTS["height"],
                 width: int | None = CALL_DEFAULTS["width"],
                 num_frames: int = CALL_DEFAULTS["num_frames"],
                 num_inference_steps: int = CALL_DEFAULTS["num_inference_steps"],
                 cfg_scale: float = CALL_DEFAULTS["cfg_scale"], seed: int | None = None, progress: bool = True,
                 output_type: str = "pil", **inputs):
        """As `WanBasePipeline.__call__`, with the variant's inputs by name (`own_inputs`)."""
        unknown = sorted(set(inputs) - set(self.own_inputs))
        if unknown:
            raise TypeError(f"{type(self).__name__}() got unexpected input(s) {unknown}; it takes "
                            f"{', '.join(self.own_inputs)}")
        values = self.prompt_values(prompt, negative_prompt)
        if input_image is not None and (height is None or width is None):
            width, height = input_image.size
        values.update({"height": height, "width": width, "num_frames": num_frames, "seed": seed,
                       "input_image": input_image, "end_image": end_image, **inputs})
        out = self.generate(values, cfg_scale=cfg_scale, num_inference_steps=num_inference_steps, progress=progress,
                            output_type=output_type)
        return out[0] if isinstance(prompt, str) and output_type == "pil" else out


__all__ = ["WanVariantPipeline", "as_list", "dit_class"]
