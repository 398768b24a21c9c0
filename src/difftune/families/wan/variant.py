"""What the Wan variant pipelines with models of their own (S2V, Wan-Dancer, LongCat-Video, Video-As-Prompt: the
sub-packages s2v/, dancer/, longcat/, vap/) share: which runs are theirs (the DiT's class), their data columns handed
to their units as the data set loaded them, stage 1 one sample at a time, and a call taking them by name."""

from __future__ import annotations

import json

from ...errors import UserError
from .pipeline import WanBasePipeline


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
    raise UserError(f"{row}: '{name}' must be a list (a JSON list such as [1, 0, 0]), got {value!r}")


class WanVariantPipeline(WanBasePipeline):
    """A Wan variant with its own models and inputs: `own_inputs` are data columns and `__call__` inputs that
    its units read as they come (clips as frames, audio as waveforms or paths, numbers, lists)."""

    own_inputs: tuple[str, ...] = ()
    encode_alone = True  # per-sample audio, clips and lists
    # their DiTs keep their released module names, which Wan's comfyui renaming does not know: the default LoRA file
    # keeps diffusers' layout
    lora_default_format = "diffusers"

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        # its own columns are handed on as the data set loaded them (the features' aligned clips as `feature_data`
        # cut them), and a call takes them by name
        cls.data_inputs = tuple(dict.fromkeys((*WanBasePipeline.data_inputs, *cls.own_inputs)))
        cls.call_parameters = {**WanBasePipeline.call_parameters, **dict.fromkeys(cls.own_inputs)}


__all__ = ["WanVariantPipeline", "as_list", "dit_class"]
