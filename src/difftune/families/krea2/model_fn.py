"""Krea-2's model_fn: one call of diffusers' `Krea2Transformer2DModel`, assembled in a `Krea2Call` (the packed image
tokens, their positions, the prompt). The DiT fuses the 12 tapped text states itself (its `text_fusion`), so a LoRA on
the fusion trains through the same call.

Latents (B, 16, h, w) are cut into 2x2 patches, (B, h/2 * w/2, 64) in (c, ph, pw) order as diffusers' pipeline and the
reference pack them; text tokens sit at position (0, 0, 0), image tokens at (0, row, column). The DiT reads the time
as sigma in [0, 1] and predicts the velocity noise - x0, as the scheduler and the loss take it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ...core.checkpointing import checkpoint_whole, set_gradient_checkpointing
from ...errors import UserError

PATCH = 2


def pack(latents: torch.Tensor) -> torch.Tensor:
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // PATCH, PATCH, w // PATCH, PATCH).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // PATCH) * (w // PATCH), c * PATCH * PATCH)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    b, _, d = tokens.shape
    c = d // (PATCH * PATCH)
    x = tokens.view(b, h // PATCH, w // PATCH, c, PATCH, PATCH).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, c, h, w)


def position_ids(text_len: int, rows: int, cols: int, device) -> torch.Tensor:
    """(text_len + rows * cols, 3): text at the origin, image tokens at (0, row, column)."""
    image = torch.zeros(rows, cols, 3, device=device)
    image[..., 1] = torch.arange(rows, device=device)[:, None]
    image[..., 2] = torch.arange(cols, device=device)[None, :]
    return torch.cat([torch.zeros(text_len, 3, device=device), image.reshape(rows * cols, 3)])


@dataclass
class Krea2Call:
    """One denoiser call being assembled: the packed image tokens `x`, the time `t` (sigma), the prompt's stacked
    hidden states and mask, the positions of the joint sequence."""

    pipe: Any
    dit: Any
    values: Mapping[str, Any]
    x: torch.Tensor
    t: torch.Tensor
    prompt_embeds: torch.Tensor
    prompt_embeds_mask: torch.Tensor | None
    positions: torch.Tensor


def model_fn_krea2(dit, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor,
                   prompt_embeds_mask: torch.Tensor | None = None, *, pipe=None, features=(),
                   use_gradient_checkpointing: bool = False, use_gradient_checkpointing_offload: bool = False,
                   **inputs: Any) -> torch.Tensor:
    """latents (B, 16, h, w), timestep (B,) in [0, 1000], prompt_embeds (B, L, 12, D) -> velocity (B, 16, h, w)."""
    if prompt_embeds is None:
        raise UserError("Krea-2 needs the prompt's hidden states (run the prompt unit with a text encoder)")
    b, _, h, w = latents.shape
    dtype = next(dit.parameters()).dtype
    t = (timestep.to(device=latents.device, dtype=torch.float32).reshape(-1).expand(b) / 1000).to(dtype)
    mask = None if prompt_embeds_mask is None else prompt_embeds_mask.to(latents.device).bool()
    set_gradient_checkpointing(dit, use_gradient_checkpointing, use_gradient_checkpointing_offload)
    # diffusers checkpoints the transformer blocks only: the text fusion's four blocks (12 text layers per token)
    # kept their activations, and model offload refused to stream them
    checkpoint_whole(dit.text_fusion, use_gradient_checkpointing, use_gradient_checkpointing_offload)
    call = Krea2Call(pipe, dit, inputs, pack(latents.to(dtype)), t, prompt_embeds.to(dtype), mask,
                     position_ids(prompt_embeds.shape[1], h // PATCH, w // PATCH, latents.device))
    for feature in features:
        if feature.in_call(inputs):
            feature.denoise(pipe, call)
    out = dit(hidden_states=call.x, encoder_hidden_states=call.prompt_embeds, timestep=call.t,
              position_ids=call.positions, encoder_attention_mask=call.prompt_embeds_mask, return_dict=False)[0]
    return unpack(out, h, w).to(latents.dtype)
