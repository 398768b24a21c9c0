"""FLEX.2-preview (ostris/Flex.2-preview): a FLUX.1 transformer with 8 double blocks whose image input takes 33
condition channels beside the 16 latent channels: an inpaint image's latents (16, zeroed where the mask is 1), the
inpaint mask (1) and a control image's latents (16, times a strength). Absent inputs are zeros (the mask: ones), so
a plain text-to-image run feeds [0, 1, 0]. It is diffusers' `FluxTransformer2DModel` with `in_channels=196`
(= 4 * (16 + 33), 2x2 patches) and `out_channels=64`; the release is one file in BFL's layout.

The control is used until `flex_control_stop` of the way through the timesteps (1: always), after which the
model sees the condition with zero control latents (the reference's "uncondition").
"""

from __future__ import annotations

import torch

from ...core.features import IMAGE, VALUE, Feature
from ...core.options import sample_input
from ...core.units import PipelineUnit
from ...errors import UserError
from ...media.image import images_to_tensor
from .components import FLEX2_TRANSFORMER_CONFIG, flux_axes_dims, infer_flux_config  # noqa: F401  (re-exported)

LATENT_CHANNELS = 16
FLEX_CONDITION_CHANNELS = 2 * LATENT_CHANNELS + 1  # inpaint latents, mask, control latents
FLEX_IN_CHANNELS = 4 * (LATENT_CHANNELS + FLEX_CONDITION_CHANNELS)  # 196


def is_flex(config) -> bool:
    """Whether a transformer config is FLEX.2's (its image input has the 33 condition channels)."""
    return bool(config) and config.get("in_channels") == FLEX_IN_CHANNELS


def _mask_tensor(mask, height: int, width: int) -> torch.Tensor:
    """A mask image -> (1, 1, h, w) in [0, 1] at latent size: its first channel, resized as the reference does
    (PIL's default bicubic, then (x / 127.5 - 1 + 1) / 2 = x / 255)."""
    from PIL import Image

    image = mask.convert("RGB").resize((width, height), Image.BICUBIC)
    return images_to_tensor(image)[:, :1].add(1).div(2)


# With a control image, one default each wherever a value is not given (a training row, validation, `difftune
# sample`, the Python call): the reference's pipeline call's (its training unit falls back to a stop of 1, so a row
# without the column trained with a control its sampling default then drops halfway).
CALL_DEFAULTS = {"flex_control_strength": 0.5, "flex_control_stop": 0.5}


class FluxFlexConditioner(PipelineUnit):
    """FLEX.2's condition channels (B, 33, H/8, W/8): [inpaint latents * (1 - mask), mask, control latents *
    strength], zeros for an absent image and ones for an absent mask. Writes the condition, the condition without
    control (used after the stop) and the stop fraction (the model_fn turns it into a timestep)."""

    feature = "flex"
    before = ("FluxClipEmbedder",)
    inputs = ("height", "width", "batch_size", "flex_inpaint_image", "flex_inpaint_mask", "flex_control_image",
              "flex_control_strength", "flex_control_stop")
    outputs = ("flex_condition", "flex_uncondition", "flex_control_stop")
    models = ("vae",)
    batching = {"flex_control_stop": "same"}

    def process(self, pipe, height, width, batch_size, flex_inpaint_image, flex_inpaint_mask, flex_control_image,
                flex_control_strength, flex_control_stop):
        from ...parts.flux_ae import vae_encode

        b = int(batch_size or 1)
        h, w = height // 8, width // 8
        zeros = torch.zeros(b, LATENT_CHANNELS, h, w, device=pipe.device, dtype=pipe.torch_dtype)
        inpaint = zeros if flex_inpaint_image is None else \
            vae_encode(pipe, images_to_tensor(flex_inpaint_image, height, width)).expand(b, -1, -1, -1)
        if flex_inpaint_mask is None:
            mask = torch.ones(b, 1, h, w, device=pipe.device, dtype=pipe.torch_dtype)
        else:
            masks = flex_inpaint_mask if isinstance(flex_inpaint_mask, list) else [flex_inpaint_mask]
            mask = torch.cat([_mask_tensor(m, h, w) for m in masks]).to(pipe.device, pipe.torch_dtype)
            mask = mask.expand(b, -1, -1, -1)
        inpaint = inpaint * (1 - mask)
        if flex_control_image is None:
            control, default_stop = zeros, 1.0  # nothing to stop
        else:
            strength = CALL_DEFAULTS["flex_control_strength"] if flex_control_strength is None else \
                _number(flex_control_strength, "flex_control_strength")
            control = vae_encode(pipe, images_to_tensor(flex_control_image, height, width)).expand(b, -1, -1, -1)
            control = control * strength
            default_stop = CALL_DEFAULTS["flex_control_stop"]
        stop = default_stop if flex_control_stop is None else _number(flex_control_stop, "flex_control_stop")
        if not 0.0 <= stop <= 1.0:
            raise UserError(f"flex_control_stop: {stop} is not a fraction of the timesteps in [0, 1]")
        return {"flex_condition": torch.cat([inpaint, mask, control], dim=1).contiguous(),
                "flex_uncondition": torch.cat([inpaint, mask, torch.zeros_like(control)], dim=1).contiguous(),
                "flex_control_stop": stop}


def _number(value, name: str) -> float:
    if isinstance(value, (list, tuple)):
        if len({float(v) for v in value}) > 1:
            raise UserError(f"{name}: one value per batch (got {list(value)}); --batch_size 1 avoids it")
        value = value[0]
    try:
        return float(value)
    except (TypeError, ValueError):
        raise UserError(f"{name}: expected a number, got {value!r:.40}") from None


def flex_stop_timestep(timesteps: torch.Tensor, stop: float) -> float:
    """The timestep at `stop` of the way through the schedule (the reference's
    timesteps[int(stop * (len - 1))]); the control applies while t >= it."""
    return float(timesteps[int(stop * (len(timesteps) - 1))])


def flex_latents(latents: torch.Tensor, timestep: torch.Tensor, flex_condition: torch.Tensor | None = None,
                 flex_uncondition: torch.Tensor | None = None, flex_stop_t: float | None = None) -> torch.Tensor:
    """model_fn's part: the noisy latents (B, 16, h, w) with FLEX.2's condition channels appended (B, 49, h, w),
    the control dropped (per sample) once the timestep is below the stop. Unchanged without a condition."""
    if flex_condition is None:
        return latents
    condition = flex_condition.to(device=latents.device, dtype=latents.dtype)
    if flex_stop_t is not None and flex_uncondition is not None:
        control = (timestep.reshape(-1, 1, 1, 1).to(latents.device) >= flex_stop_t)
        condition = torch.where(control, condition, flex_uncondition.to(device=latents.device, dtype=latents.dtype))
    return torch.cat([latents, condition.expand(latents.shape[0], -1, -1, -1)], dim=1)


def flex_stop_t(pipe, stop) -> float | None:
    """FLEX.2's control stops at the timestep `stop` of the way through the schedule (the reference's
    timesteps[int(stop * (n - 1))]; the training table's in training); None: never."""
    if stop is None or float(stop) >= 1.0 or pipe is None:
        return None
    scheduler = pipe.scheduler
    timesteps = scheduler.training_table(scheduler.training_mu())[1] if scheduler.training else \
        scheduler.timesteps
    return flex_stop_timestep(timesteps, float(stop))




class _Flex(Feature):
    def prepare_call(self, pipe, values, cfg_scale, state):
        """The control's strength and stop apply with a control image only (sampling's defaults: 0.5 and 0.5)."""
        for name, default in CALL_DEFAULTS.items():
            if values.get("flex_control_image") is None:
                values.pop(name, None)
            elif values.get(name) is None:
                values[name] = default

    def denoise(self, pipe, call):
        """The condition channels after the noisy latents' (without the control after the stop)."""
        v = call.values
        if v.get("flex_condition") is None:
            return
        latents = call.latents
        x = flex_latents(latents, call.timestep, v["flex_condition"], v.get("flex_uncondition"),
                         flex_stop_t(pipe, v.get("flex_control_stop")))
        call.channels.append(x[:, latents.shape[1]:])
        call.channels_for = "the FLEX.2 condition is for a FLEX.2 DiT"


IMAGE_COLUMNS = ("flex_inpaint_image", "flex_inpaint_mask", "flex_control_image")
VALUE_COLUMNS = ("flex_control_strength", "flex_control_stop")
FLEX = _Flex("flex", columns=IMAGE_COLUMNS, data_inputs=IMAGE_COLUMNS + VALUE_COLUMNS,
             model_fn_inputs=("flex_condition", "flex_uncondition", "flex_control_stop"),
             units=(FluxFlexConditioner(),), inputs={**dict.fromkeys(IMAGE_COLUMNS, IMAGE),
                                                     **dict.fromkeys(VALUE_COLUMNS, VALUE)},
             call_inputs={**dict.fromkeys(IMAGE_COLUMNS), **CALL_DEFAULTS},
             flags={"flex_inpaint_image": sample_input("FLEX.2: the image to inpaint.", load="RGB"),
                    "flex_inpaint_mask": sample_input("FLEX.2: the region to inpaint (light).", load="RGB"),
                    "flex_control_image": sample_input("FLEX.2: a control image (pose, depth, ...).", load="RGB")},
             description="FLEX.2: inpaint and control images as condition channels")
