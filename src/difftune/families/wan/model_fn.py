"""Wan's model_fn: one call of diffusers' `WanTransformer3DModel` on (B, C, F, H, W) latents."""

from __future__ import annotations

from typing import Any

import torch

from ...core.checkpointing import set_gradient_checkpointing
from ...errors import UserError


def first_frame_timesteps(timestep: torch.Tensor, latents: torch.Tensor, patch: int = 2) -> torch.Tensor:
    """(B,) -> (B, tokens): every token at its sample's timestep except the first latent frame's, at 0 (TI2V-5B's
    clean first frame, as diffusers' `expand_timesteps`)."""
    f, h, w = latents.shape[2], latents.shape[3] // patch, latents.shape[4] // patch
    mask = torch.ones(f, h, w, device=latents.device, dtype=torch.float32)
    mask[0] = 0
    return mask.flatten()[None] * timestep.reshape(-1, 1).to(torch.float32)


def model_fn_wan(dit, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor,
                 image_embeds: torch.Tensor | None = None, condition: torch.Tensor | None = None,
                 first_frame_latents: torch.Tensor | None = None, end_image_embeds: torch.Tensor | None = None,
                 use_gradient_checkpointing: bool = False,
                 use_gradient_checkpointing_offload: bool = False, **_: Any) -> torch.Tensor:
    """One denoiser call: latents (B, C, F, h, w), timestep (B,) in [0, 1000] -> velocity (B, C, F, h, w).

    I2V DiTs (in_channels > out_channels) take `condition` on channels and, Wan2.1 I2V 14B, `image_embeds`;
    with `first_frame_latents` (TI2V-5B) the first latent frame is replaced by them at timestep 0. The end image's
    CLIP tokens are used by a DiT with image position embeddings for two images (FLF2V) only."""
    config = dit.config
    takes_condition = config.in_channels != config.out_channels
    if takes_condition and condition is None:
        raise UserError("this Wan DiT is image-to-video: give an input image (--extra_inputs input_image)")
    if condition is not None and not takes_condition:
        raise UserError("an input image was given but this Wan DiT is text-to-video (it takes no image condition)")
    if config.image_dim is not None and image_embeds is None:
        raise UserError("this Wan DiT (I2V 14B) needs the CLIP image embedding: load the image encoder too")
    if image_embeds is not None and config.image_dim is None:
        raise UserError("a CLIP image encoder is loaded but this Wan DiT takes no image embedding: leave it out")
    if config.pos_embed_seq_len is not None and image_embeds is not None:
        # FLF2V: the first and the last frame's CLIP tokens as consecutive rows, which diffusers'
        # WanImageEmbedding views as one sequence of both per sample
        if end_image_embeds is None:
            raise UserError("this Wan DiT (first-last-frame) needs an end image as well (--extra_inputs end_image)")
        pair = torch.stack([image_embeds, end_image_embeds.to(image_embeds.dtype)], dim=1)
        image_embeds = pair.reshape(-1, *image_embeds.shape[1:])
    # otherwise the end image conditions through `condition` alone, as in the reference
    b = latents.shape[0]
    dtype = dit.dtype if dit.dtype.is_floating_point else latents.dtype
    set_gradient_checkpointing(dit, use_gradient_checkpointing, use_gradient_checkpointing_offload)
    x = latents
    t = timestep.to(latents.device).expand(b)
    if first_frame_latents is not None:
        x = torch.cat([first_frame_latents.to(x.dtype), x[:, :, 1:]], dim=2)
        t = first_frame_timesteps(t, x)
    if condition is not None:
        x = torch.cat([x, condition.to(x.dtype)], dim=1)
    out = dit(hidden_states=x.to(dtype), timestep=t, encoder_hidden_states=prompt_embeds.to(dtype),
              encoder_hidden_states_image=None if image_embeds is None else image_embeds.to(dtype),
              return_dict=False)[0]
    return out
