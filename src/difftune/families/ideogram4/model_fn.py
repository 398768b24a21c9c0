"""Ideogram-4's model_fn: one call of diffusers' `Ideogram4Transformer2DModel` on the packed sequence
[text tokens][image tokens], assembled in an `Ideogram4Call` (each feature of the call may change it before the
sequence is built; the reference's scripts use none).

The conditional pass packs the prompt's features before the image tokens (padding, if a batch has prompts of
several lengths, in a segment of its own that no real token sees); the unconditional pass (the negative side of
guidance: `prompt_embeds` None) is the image tokens alone with zero text features, through the unconditional DiT
when one is loaded, else through the DiT itself (as the reference). The DiT predicts data - noise at model time
t = 1 - sigma; the velocity the losses and the sampler use is its negation.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ...core.checkpointing import set_gradient_checkpointing
from ...errors import UserError
from .units import grid_to_tokens, tokens_to_grid

LLM_TOKEN, OUTPUT_IMAGE, PADDING_SEGMENT = 3, 2, -1
IMAGE_POSITION_OFFSET = 65536  # image positions never meet text positions


def image_positions(h: int, w: int, device) -> torch.Tensor:
    """(h*w, 3) (t, row, column) positions of the image tokens."""
    rows = torch.arange(h, device=device).view(-1, 1).expand(h, w).reshape(-1)
    cols = torch.arange(w, device=device).view(1, -1).expand(h, w).reshape(-1)
    return torch.stack([torch.zeros_like(rows), rows, cols], dim=1) + IMAGE_POSITION_OFFSET


@dataclass
class Ideogram4Call:
    """One denoiser call being assembled: the image `tokens` (B, N, 128), the model time `t` (B,), the text features
    `text` (B, L, D) with `text_mask` (B, L), or None for the unconditional pass, on the `grid` (h, w)."""

    pipe: Any
    dit: Any
    values: Mapping[str, Any]
    tokens: torch.Tensor
    t: torch.Tensor
    text: torch.Tensor | None
    text_mask: torch.Tensor | None
    grid: tuple[int, int]

    def sequence(self) -> dict[str, torch.Tensor]:
        """The DiT's inputs for the packed sequence."""
        b, n, c = self.tokens.shape
        device = self.tokens.device
        h, w = self.grid
        image_pos = image_positions(h, w, device).unsqueeze(0).expand(b, n, 3)
        width = self.dit.config.llm_features_dim
        if self.text is None:
            hidden, features, positions = self.tokens, self.tokens.new_zeros(b, n, width), image_pos
            segments = torch.ones(b, n, dtype=torch.long, device=device)
            indicator = torch.full((b, n), OUTPUT_IMAGE, dtype=torch.long, device=device)
        else:
            length = self.text.shape[1]
            mask = (torch.ones(b, length, dtype=torch.long, device=device) if self.text_mask is None
                    else self.text_mask.to(device=device, dtype=torch.long))
            text_pos = ((mask.cumsum(1) - 1).clamp(min=0) * mask).unsqueeze(-1).expand(b, length, 3)
            hidden = torch.cat([self.tokens.new_zeros(b, length, c), self.tokens], dim=1)
            text = self.text.to(device=device, dtype=self.tokens.dtype) * mask.unsqueeze(-1).to(self.tokens.dtype)
            features = torch.cat([text, self.tokens.new_zeros(b, n, width)], dim=1)
            positions = torch.cat([text_pos, image_pos], dim=1)
            ones = torch.ones(b, n, dtype=torch.long, device=device)
            segments = torch.cat([torch.where(mask.bool(), 1, PADDING_SEGMENT), ones], dim=1)
            indicator = torch.cat([mask * LLM_TOKEN, ones * OUTPUT_IMAGE], dim=1)
        return {"hidden_states": hidden, "encoder_hidden_states": features, "position_ids": positions,
                "segment_ids": segments, "indicator": indicator}


def model_fn_ideogram4(dit, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor | None,
                       prompt_embeds_mask: torch.Tensor | None = None, *, dit_uncond=None, pipe=None, features=(),
                       use_gradient_checkpointing: bool = False, use_gradient_checkpointing_offload: bool = False,
                       **inputs: Any) -> torch.Tensor:
    """latents (B, 128, h, w), timestep (B,) in [0, 1000] -> velocity (B, 128, h, w)."""
    model = dit if prompt_embeds is not None or dit_uncond is None else dit_uncond
    if model is None:
        raise UserError("no Ideogram-4 DiT loaded")
    b, _, h, w = latents.shape
    dtype = next(model.parameters()).dtype
    t = 1.0 - timestep.to(device=latents.device, dtype=torch.float32).reshape(-1).expand(b) / 1000
    set_gradient_checkpointing(model, use_gradient_checkpointing, use_gradient_checkpointing_offload)
    call = Ideogram4Call(pipe, model, inputs, grid_to_tokens(latents.float()), t, prompt_embeds, prompt_embeds_mask,
                         (h, w))
    for feature in features:
        if feature.in_call(inputs):
            feature.denoise(pipe, call)
    seq = call.sequence()
    text_length = seq["hidden_states"].shape[1] - call.tokens.shape[1]
    out = model(hidden_states=seq["hidden_states"].to(dtype), timestep=t.to(dtype),
                encoder_hidden_states=seq["encoder_hidden_states"].to(dtype), position_ids=seq["position_ids"],
                segment_ids=seq["segment_ids"], indicator=seq["indicator"], return_dict=False)[0]
    v = out[:, text_length:text_length + call.tokens.shape[1]].float()
    return -tokens_to_grid(v, h, w).to(latents.dtype)


__all__ = ["IMAGE_POSITION_OFFSET", "Ideogram4Call", "image_positions", "model_fn_ideogram4"]
