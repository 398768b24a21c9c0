"""ERNIE-Image's model_fn: one call of diffusers' `ErnieImageTransformer2DModel`, assembled in an `ErnieImageCall`.

The DiT reads the (B, 128, h, w) latents as they are (patch size 1), the prompt padded with its real lengths
(`text_lens`), and the time in [0, 1000]; it predicts the flow's velocity (noise - x0) directly, which the sampler
steps with and the losses compare against.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ...core.checkpointing import set_gradient_checkpointing


@dataclass
class ErnieImageCall:
    """One denoiser call: the latents, the time per sample, the padded prompt and its real lengths."""

    dit: Any
    values: Mapping[str, Any]
    latents: torch.Tensor
    t: torch.Tensor
    text: torch.Tensor
    text_lens: torch.Tensor

    def run(self) -> torch.Tensor:
        return self.dit(hidden_states=self.latents, timestep=self.t, text_bth=self.text, text_lens=self.text_lens,
                        return_dict=False)[0]


def text_lengths(prompt_embeds: torch.Tensor, prompt_embeds_mask: torch.Tensor | None) -> torch.Tensor:
    """The prompt's real lengths per sample (its mask's sums; no mask: all of it)."""
    if prompt_embeds_mask is None:
        return torch.full((prompt_embeds.shape[0],), prompt_embeds.shape[1], dtype=torch.long,
                          device=prompt_embeds.device)
    return prompt_embeds_mask.to(device=prompt_embeds.device).long().sum(dim=1)


def model_fn_ernie_image(dit, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor,
                         prompt_embeds_mask: torch.Tensor | None = None, *, use_gradient_checkpointing: bool = False,
                         use_gradient_checkpointing_offload: bool = False, **inputs: Any) -> torch.Tensor:
    """latents (B, 128, h, w), timestep (B,) or (1,) in [0, 1000] -> velocity (B, 128, h, w)."""
    b = latents.shape[0]
    dtype = next(dit.parameters()).dtype
    t = timestep.to(device=latents.device, dtype=dtype).reshape(-1).expand(b)
    set_gradient_checkpointing(dit, use_gradient_checkpointing, use_gradient_checkpointing_offload)
    call = ErnieImageCall(dit, inputs, latents.to(dtype), t, prompt_embeds.to(device=latents.device, dtype=dtype),
                          text_lengths(prompt_embeds, prompt_embeds_mask))
    return call.run().to(latents.dtype)
