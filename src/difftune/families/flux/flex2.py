"""FLEX.2-preview (ostris/Flex.2-preview): a FLUX.1 transformer with 8 double blocks whose image input takes 33
condition channels beside the 16 latent channels: an inpaint image's latents (16, zeroed where the mask is 1), the
inpaint mask (1) and a control image's latents (16, times a strength). Absent inputs are zeros (the mask: ones), so
a plain text-to-image run feeds [0, 1, 0]. It is diffusers' `FluxTransformer2DModel` with `in_channels=196`
(= 4 * (16 + 33), 2x2 patches) and `out_channels=64`; the release is one file in BFL's layout.

The control is used until `flex_control_stop` of the way through the timesteps (1: always), after which the
model sees the condition with zero control latents (the reference's "uncondition").
"""

from __future__ import annotations

import re

import torch

from ...core.units import PipelineUnit
from ...errors import UserError
from ...media.image import images_to_tensor
from ...models.detect import ComponentSpec
from .bfl import convert_bfl_transformer
from .components import FLUX1_DEV_TRANSFORMER_CONFIG, transformer_key

LATENT_CHANNELS = 16
FLEX_CONDITION_CHANNELS = 2 * LATENT_CHANNELS + 1  # inpaint latents, mask, control latents
FLEX_IN_CHANNELS = 4 * (LATENT_CHANNELS + FLEX_CONDITION_CHANNELS)  # 196

FLEX2_TRANSFORMER_CONFIG = {**FLUX1_DEV_TRANSFORMER_CONFIG, "in_channels": FLEX_IN_CHANNELS, "out_channels": 64,
                            "num_layers": 8}


def _count(shapes, head: str) -> int:
    pattern = re.compile(rf"^{re.escape(head)}\.(\d+)\.")
    ids = {int(m.group(1)) for k in shapes if (m := pattern.match(k))}
    return max(ids) + 1 if ids else 0


def flux_axes_dims(head_dim: int) -> list[int] | None:
    """FLUX.1's RoPE split of a head (16, 56, 56 of 128) at another head size: 1/8, 7/16, 7/16 (even parts only)."""
    if head_dim % 32:
        return None
    return [head_dim // 8, head_dim * 7 // 16, head_dim * 7 // 16]


def infer_flux_config(shapes: dict[str, tuple[int, ...]]) -> dict | None:
    """A FluxTransformer2DModel config from its tensors' shapes (diffusers names): every size shows in the weights
    (input and output channels, width, head size, depths, text widths, the guidance embedder) except the RoPE split,
    which follows FLUX.1's proportions (`flux_axes_dims`)."""
    try:
        width, in_channels = shapes["x_embedder.weight"]
        head_dim = shapes["transformer_blocks.0.attn.norm_q.weight"][0]
        config = {
            "_class_name": "FluxTransformer2DModel", "patch_size": 1,
            "in_channels": in_channels, "out_channels": shapes["proj_out.weight"][0],
            "attention_head_dim": head_dim, "num_attention_heads": width // head_dim,
            "num_layers": _count(shapes, "transformer_blocks"),
            "num_single_layers": _count(shapes, "single_transformer_blocks"),
            "joint_attention_dim": shapes["context_embedder.weight"][1],
            "pooled_projection_dim": shapes["time_text_embed.text_embedder.linear_1.weight"][1],
            "guidance_embeds": "time_text_embed.guidance_embedder.linear_1.weight" in shapes,
        }
    except (KeyError, ValueError, IndexError):
        return None
    axes = flux_axes_dims(head_dim)
    if axes is None:
        return None
    config["axes_dims_rope"] = axes
    return config


DIT_FLEX2 = ComponentSpec(
    name="dit", library="diffusers", class_name="FluxTransformer2DModel",
    known_configs={"ostris/Flex.2-preview transformer": FLEX2_TRANSFORMER_CONFIG},
    marker_keys=("img_in.weight", "double_blocks.0.img_attn.qkv.weight", "final_layer.linear.weight"),
    normalize_key=transformer_key, convert_state_dict=convert_bfl_transformer, infer_config=infer_flux_config,
    description="FLUX.1 MMDiT in BFL's layout, any depth / input channels (FLEX.2-preview: 8 double blocks, "
                "196 input channels)")


def is_flex(config) -> bool:
    """Whether a transformer config is FLEX.2's (its image input has the 33 condition channels)."""
    return bool(config) and config.get("in_channels") == FLEX_IN_CHANNELS


def _mask_tensor(mask, height: int, width: int) -> torch.Tensor:
    """A mask image -> (1, 1, h, w) in [0, 1] at latent size: its first channel, resized as the reference does
    (PIL's default bicubic, then (x / 127.5 - 1 + 1) / 2 = x / 255)."""
    from PIL import Image

    image = mask.convert("RGB").resize((width, height), Image.BICUBIC)
    return images_to_tensor(image)[:, :1].add(1).div(2)


class FluxFlexConditioner(PipelineUnit):
    """FLEX.2's condition channels (B, 33, H/8, W/8): [inpaint latents * (1 - mask), mask, control latents *
    strength], zeros for an absent image and ones for an absent mask. Writes the condition, the condition without
    control (used after the stop) and the stop fraction (the model_fn turns it into a timestep)."""

    feature = "flex"
    inputs = ("height", "width", "batch_size", "flex_inpaint_image", "flex_inpaint_mask", "flex_control_image",
              "flex_control_strength", "flex_control_stop")
    outputs = ("flex_condition", "flex_uncondition", "flex_control_stop")
    models = ("vae",)
    batching = {"flex_control_stop": "same"}

    def process(self, pipe, height, width, batch_size, flex_inpaint_image, flex_inpaint_mask, flex_control_image,
                flex_control_strength, flex_control_stop):
        from .units import vae_encode

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
            control = zeros
        else:
            strength = 0.5 if flex_control_strength is None else _number(flex_control_strength, "flex_control_strength")
            control = vae_encode(pipe, images_to_tensor(flex_control_image, height, width)).expand(b, -1, -1, -1)
            control = control * strength
        stop = 1.0 if flex_control_stop is None else _number(flex_control_stop, "flex_control_stop")
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
    the control dropped once the timestep is below the stop. Unchanged without a condition."""
    if flex_condition is None:
        return latents
    use_control = flex_stop_t is None or float(timestep.reshape(-1)[0]) >= flex_stop_t
    condition = flex_condition if use_control or flex_uncondition is None else flex_uncondition
    return torch.cat([latents, condition.to(device=latents.device, dtype=latents.dtype)], dim=1)
