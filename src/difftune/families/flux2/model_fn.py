"""One FLUX.2 denoiser call, shared by sampling and training: the latents flattened to tokens with their (t, h, w, l)
positions, the prompt's tokens with theirs, the DiT, and the prediction for the latents' own tokens back in the
latent layout. A feature adds tokens after the image's (reference / edit images: `Flux2Call.extra`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from ...core.checkpointing import set_gradient_checkpointing
from .latents import image_ids, text_ids


@dataclass
class Flux2Call:
    """What a feature may add to the call: `extra` holds (tokens (B, N, 128), positions (N, 4)) pairs that join the
    image's tokens (their predictions are dropped)."""

    pipe: Any
    dit: Any
    values: dict
    extra: list = field(default_factory=list)


def model_fn_flux2(dit, latents, timestep, prompt_embeds, guidance=None, *, pipe=None, features=(),
                   use_gradient_checkpointing=False, use_gradient_checkpointing_offload=False, **inputs):
    b, c, h, w = latents.shape
    dtype = dit.dtype
    device = latents.device
    x = latents.reshape(b, c, h * w).permute(0, 2, 1)
    ids = image_ids(h, w).to(device)
    call = Flux2Call(pipe, dit, inputs)
    for feature in features:
        if feature.in_call(inputs):
            feature.denoise(pipe, call)
    if call.extra:
        x = torch.cat([x, *(tokens.to(x.dtype) for tokens, _ in call.extra)], dim=1)
        ids = torch.cat([ids, *(pos.to(device) for _, pos in call.extra)], dim=0)
    if getattr(dit.config, "guidance_embeds", False):
        if guidance is None:
            raise ValueError("FLUX.2-dev needs its embedded guidance (the guidance value)")
        guidance = guidance.to(device, torch.float32).expand(b)
    else:
        guidance = None
    set_gradient_checkpointing(dit, use_gradient_checkpointing, use_gradient_checkpointing_offload)
    t = timestep.to(device).reshape(-1).expand(b).to(latents.dtype)
    out = dit(hidden_states=x.to(dtype), encoder_hidden_states=prompt_embeds.to(dtype), timestep=t / 1000,
              img_ids=ids, txt_ids=text_ids(prompt_embeds.shape[1]).to(device), guidance=guidance,
              return_dict=False)[0]
    return out[:, :h * w].permute(0, 2, 1).reshape(b, -1, h, w).to(latents.dtype)


__all__ = ["Flux2Call", "model_fn_flux2"]
