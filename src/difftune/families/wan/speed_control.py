"""Speed control (DiffSynth-Studio/Wan2.1-1.3b-speedcontrol-v1, on Wan2.1-T2V-1.3B).

A motion controller maps `motion_bucket_id` (a number per clip) to a residual on the DiT blocks' time modulation:
a sinusoidal embedding of 10 x the id, then Linear-SiLU-Linear-SiLU-Linear to 6 x the DiT width, added to the
blocks' (B, 6, D) modulation only (not the head's). diffusers has no such model: `WanMotionController` is written
from the reference's published architecture, with the released file's key names (linear.0 / .2 / .4).
"""

from __future__ import annotations

import math

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from torch import nn

from ...core.features import VALUE, Feature
from ...core.units import PipelineUnit
from ...errors import UserError
from ...models.detect import ComponentSpec
from .units import _per_sample

ID_SCALE = 10  # the reference embeds 10 x motion_bucket_id


def sinusoid(dim: int, position: torch.Tensor) -> torch.Tensor:
    """(B,) -> (B, dim): cos then sin of position x 10000^(-k / (dim/2)), computed in float64 (as Wan's time
    embedding), returned in the position's dtype."""
    half = dim // 2
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=position.device) / half)
    angles = position.to(torch.float64)[:, None] * freqs[None]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=1).to(position.dtype)


class WanMotionController(ModelMixin, ConfigMixin):
    """The `motion_controller` slot: motion_bucket_id (B,) -> (B, 6 * dim) time-modulation residual."""

    @register_to_config
    def __init__(self, freq_dim: int = 256, dim: int = 1536):
        super().__init__()
        self.linear = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim), nn.SiLU(),
                                    nn.Linear(dim, dim * 6))

    def forward(self, motion_bucket_id: torch.Tensor) -> torch.Tensor:
        ids = motion_bucket_id.reshape(-1).to(self.linear[0].weight.dtype)
        return self.linear(sinusoid(self.config.freq_dim, ids * ID_SCALE))

    def zero_init(self) -> None:
        """The reference's start for training from scratch: the last layer zero, so the DiT is unchanged."""
        nn.init.zeros_(self.linear[-1].weight)
        nn.init.zeros_(self.linear[-1].bias)


def _config_from_weights(shapes: dict[str, tuple[int, ...]]) -> dict | None:
    first, last = shapes.get("linear.0.weight"), shapes.get("linear.4.weight")
    if first is None or last is None or len(first) != 2 or last != (6 * first[0], first[0]):
        return None
    return {"_class_name": "WanMotionController", "freq_dim": first[1], "dim": first[0]}


MOTION_CONTROLLER = ComponentSpec(
    name="motion_controller", library=__name__, class_name="WanMotionController",
    known_configs={"DiffSynth-Studio/Wan2.1-1.3b-speedcontrol-v1":
                   {"_class_name": "WanMotionController", "freq_dim": 256, "dim": 1536}},
    marker_keys=("linear.0.weight", "linear.2.weight", "linear.4.weight"), infer_config=_config_from_weights,
    description="Wan speed-control motion controller (DiffSynth-Studio/Wan2.1-1.3b-speedcontrol-v1)")


def _number(value, row="") -> float:
    try:
        number = float(value)
    except (TypeError, ValueError):
        number = math.nan
    if not math.isfinite(number):
        raise UserError(f"motion_bucket_id {value!r}: expected a number (the clip's speed bucket)")
    return number


class WanSpeedControl(PipelineUnit):
    """motion_bucket_id (a number per clip; a data column is read as text) -> a (B,) tensor. No model."""

    feature = "speed_control"
    inputs = ("motion_bucket_id", "batch_size")
    outputs = ("motion_bucket_id",)
    skip_without = ("motion_bucket_id",)

    def process(self, pipe, motion_bucket_id, batch_size):
        if isinstance(motion_bucket_id, torch.Tensor):
            return {"motion_bucket_id": motion_bucket_id.reshape(-1).to(pipe.device, torch.float32)}
        ids = [_number(v) for v in _per_sample(motion_bucket_id, int(batch_size or 1))]
        return {"motion_bucket_id": torch.tensor(ids, dtype=torch.float32, device=pipe.device)}


def motion_time_residual(motion_controller, motion_bucket_id: torch.Tensor | None) -> torch.Tensor | None:
    """The (B, 6 * D) residual for `wan_dit_forward(timestep_proj_residual=...)`, or None without an id or a
    controller."""
    if motion_bucket_id is None or motion_controller is None:
        return None
    return motion_controller(motion_bucket_id)


class WanMotionResidual(PipelineUnit):
    """The motion controller's residual on the DiT's block modulation: cached by stage 1 when the controller is
    frozen (a LoRA on the DiT), recomputed in stage 2 when it is trained (--trainable_models motion_controller)."""

    feature = "speed_control"
    inputs = ("motion_bucket_id",)
    outputs = ("motion_residual",)
    models = ("motion_controller",)

    def process(self, pipe, motion_bucket_id):
        residual = motion_time_residual(pipe.models.get("motion_controller"), motion_bucket_id)
        return {} if residual is None else {"motion_residual": residual}



class _SpeedControl(Feature):
    def denoise(self, pipe, call):
        """The motion controller's residual on the blocks' time modulation."""
        call.timestep_proj_residual = call.values["motion_residual"]


SPEED_CONTROL = _SpeedControl(
    "speed_control", columns=("motion_bucket_id",), model_fn_inputs=("motion_residual",),
    units=(WanSpeedControl(), WanMotionResidual()), slots=("motion_controller",),
    components=(MOTION_CONTROLLER,), native_keys={"motion_controller": dict},
    needs={"motion_controller": "the motion controller (DiffSynth-Studio/Wan2.1-1.3b-speedcontrol-v1's "
                                "model.safetensors)"},
    inputs={"motion_bucket_id": VALUE}, call_inputs={"motion_bucket_id": None},
    description="speed control: the motion controller's residual on the time modulation")

__all__ = ["MOTION_CONTROLLER", "WanMotionController", "WanMotionResidual", "WanSpeedControl", "motion_time_residual",
           "sinusoid", "SPEED_CONTROL"]
