"""Anima's model_fn: the LLM adapter over the prompt's Qwen3 states and T5 ids, then the Cosmos-Predict2 DiT on the
latents as one frame, the time in [0, 1] (the reference divides its 0..1000 timestep by 1000, as diffusers' Anima
pipeline does); the output is the flow's velocity (noise - x0)."""

from __future__ import annotations

from typing import Any

import torch

from ...core.checkpointing import set_gradient_checkpointing


def model_fn_anima(dit, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor,
                   t5_ids: torch.Tensor, t5_mask: torch.Tensor | None = None, *, use_gradient_checkpointing: bool = False,
                   use_gradient_checkpointing_offload: bool = False, **inputs: Any) -> torch.Tensor:
    """latents (B, 16, h, w), timestep (B,) or (1,) in [0, 1000] -> velocity (B, 16, h, w)."""
    b = latents.shape[0]
    dtype = next(dit.parameters()).dtype
    t = (timestep.to(device=latents.device, dtype=torch.float32).reshape(-1).expand(b) / 1000).to(dtype)
    set_gradient_checkpointing(dit, use_gradient_checkpointing, use_gradient_checkpointing_offload)
    device = latents.device
    mask = None if t5_mask is None else t5_mask.to(device)
    out = dit(latents.to(dtype).unsqueeze(2), t, prompt_embeds.to(device=device, dtype=dtype), t5_ids.to(device), mask)
    return out[:, :, 0].to(latents.dtype)
