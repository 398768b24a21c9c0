"""FLUX.1's model_fn: one call of diffusers' `FluxTransformer2DModel` on packed 2x2 latent patches."""

from __future__ import annotations

from typing import Any

import torch

from ...core.checkpointing import set_gradient_checkpointing
from ...core.latents import pack_latents, unpack_latents
from ...errors import UserError

def image_ids(h: int, w: int, device, dtype) -> torch.Tensor:
    """(h*w, 3) position ids of the packed tokens: (0, row, column), row-major (diffusers' layout)."""
    rows = torch.arange(h, device=device).view(h, 1).expand(h, w)
    cols = torch.arange(w, device=device).view(1, w).expand(h, w)
    ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(h * w, 3)
    return ids.to(dtype)


def model_fn_flux(dit, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor,
                  pooled_prompt_embeds: torch.Tensor, guidance: torch.Tensor | None = None,
                  kontext_latents: torch.Tensor | None = None, kontext_ids: torch.Tensor | None = None,
                  use_gradient_checkpointing: bool = False, use_gradient_checkpointing_offload: bool = False,
                  default_guidance: float = 3.5, **_: Any) -> torch.Tensor:
    """One denoiser call: latents (B, 16, h, w), timestep (B,) in [0, 1000] -> velocity (B, 16, h, w).

    Kontext reference tokens (B, n, 64) with their ids (B, n, 3) follow the noisy image's tokens; the output
    is cut back to the image's tokens, so a loss sees only those. `default_guidance`: the embedded guidance where
    the values have none (the pipeline's sampling default)."""
    b, _, h, w = latents.shape
    tokens = pack_latents(latents)
    image_len = tokens.shape[1]
    set_gradient_checkpointing(dit, use_gradient_checkpointing, use_gradient_checkpointing_offload)
    timestep = timestep.to(device=latents.device, dtype=latents.dtype).expand(b)
    if dit.config.guidance_embeds:
        # no guidance value (e.g. validation renders from cached prompts): the sampling default
        g = torch.full((b,), default_guidance) if guidance is None else torch.as_tensor(guidance).reshape(-1)
        guidance = g.to(device=latents.device, dtype=torch.float32).expand(b)
    else:
        guidance = None
    img_ids = image_ids(h // 2, w // 2, latents.device, latents.dtype)
    if kontext_latents is not None:
        ids = kontext_ids.to(device=latents.device, dtype=latents.dtype)
        if ids.dim() == 3:  # one row per sample; the transformer takes one set for the batch
            if not bool((ids == ids[:1]).all()):
                raise UserError("kontext_images of different sizes in one batch (--batch_size 1 avoids it)")
            ids = ids[0]
        tokens = torch.cat([tokens, kontext_latents.to(device=latents.device, dtype=latents.dtype)
                            .expand(b, -1, -1)], dim=1)
        img_ids = torch.cat([img_ids, ids], dim=0)
    txt_ids = torch.zeros(prompt_embeds.shape[1], 3, device=latents.device, dtype=latents.dtype)
    out = dit(hidden_states=tokens, timestep=timestep / 1000, guidance=guidance,
              pooled_projections=pooled_prompt_embeds.to(latents.dtype),
              encoder_hidden_states=prompt_embeds.to(latents.dtype), txt_ids=txt_ids, img_ids=img_ids,
              return_dict=False)[0]
    return unpack_latents(out[:, :image_len], h, w)
