"""Wan's model_fn: one call of diffusers' `WanTransformer3DModel` on (B, C, F, H, W) latents. The call is assembled
in a `WanCall`: the base inputs (the latents, TI2V-5B's clean first frame, the I2V condition and CLIP tokens), then
each feature of the call adds its part at the forward's hook points (dit_forward.py): Fun-Control's channels and
reference tokens, the camera adapter's residual, the motion controller's residual, VACE's hints, Animate's pose
residual and face adapter. The features' parts live in their own modules (`Feature.denoise`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
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


def _image_inputs(dit, x, condition, image_embeds, end_image_embeds):
    """The plain I2V inputs: the condition on channels (I2V DiTs), CLIP tokens (and FLF2V's end image's)."""
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
    if condition is not None:
        x = torch.cat([x, condition.to(x.dtype)], dim=1)
    return x, image_embeds


@dataclass
class WanCall:
    """One denoiser call being assembled. `values`: the call's model_fn inputs; `settings`: its run-time settings.
    A feature that puts its conditions on the channels itself sets `channels_done` (the plain image-to-video inputs
    are then not added); `image_embeds_instead` stands in for the input image's CLIP tokens on that plain path."""

    pipe: Any
    dit: Any
    low_noise: bool
    values: Mapping[str, Any]
    settings: Mapping[str, Any]
    x: torch.Tensor
    t: torch.Tensor
    image_embeds: torch.Tensor | None
    channels_done: bool = False
    image_embeds_instead: torch.Tensor | None = None
    # the forward's hook points (dit_forward.wan_dit_forward)
    patch_residual: torch.Tensor | None = None
    prefix_tokens: torch.Tensor | None = None
    timestep_proj_residual: torch.Tensor | None = None
    block_hooks: list = field(default_factory=list)

    def checkpointing(self, module) -> None:
        """Switch `module` (a feature's model in this call) to the call's gradient-checkpointing setting."""
        if module is not None:
            set_gradient_checkpointing(module, bool(self.settings.get("use_gradient_checkpointing")),
                                       bool(self.settings.get("use_gradient_checkpointing_offload")))


def model_fn_wan(pipe, dit, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor,
                 image_embeds: torch.Tensor | None = None, condition: torch.Tensor | None = None,
                 first_frame_latents: torch.Tensor | None = None, end_image_embeds: torch.Tensor | None = None, *,
                 low_noise: bool = False, features=(), settings: Mapping[str, Any] | None = None,
                 **inputs: Any) -> torch.Tensor:
    """One denoiser call: latents (B, C, F, h, w), timestep (B,) in [0, 1000] -> velocity (B, C, F, h, w).

    I2V DiTs (in_channels > out_channels) take `condition` on channels and, Wan2.1 I2V 14B, `image_embeds`;
    with `first_frame_latents` (TI2V-5B) the first latent frame is replaced by them at timestep 0. The end image's
    CLIP tokens are used by a DiT with image position embeddings for two images (FLF2V) only. `features`: the
    pipeline's features; each one whose model_fn inputs the call has adds its part (`Feature.denoise`)."""
    from .dit_forward import wan_dit_forward

    settings = dict(settings or {})
    b = latents.shape[0]
    dtype = dit.dtype if dit.dtype.is_floating_point else latents.dtype
    x = latents
    t = timestep.to(latents.device).expand(b)
    if first_frame_latents is not None:
        x = torch.cat([first_frame_latents.to(x.dtype), x[:, :, 1:]], dim=2)
        t = first_frame_timesteps(t, x)
    values = {"condition": condition, "image_embeds": image_embeds, "end_image_embeds": end_image_embeds, **inputs}
    call = WanCall(pipe, dit, low_noise, values, settings, x, t, image_embeds)
    call.checkpointing(dit)
    for feature in features:
        if feature.in_call(values):
            feature.denoise(pipe, call)
    x, image_embeds = call.x, call.image_embeds
    if not call.channels_done:
        if call.image_embeds_instead is not None:
            image_embeds = call.image_embeds_instead
        x, image_embeds = _image_inputs(dit, x, condition, image_embeds, end_image_embeds)
    hooks = {k: v for k, v in (("patch_residual", call.patch_residual), ("prefix_tokens", call.prefix_tokens),
                                 ("timestep_proj_residual", call.timestep_proj_residual)) if v is not None}
    context = dict(hidden_states=x.to(dtype), timestep=call.t, encoder_hidden_states=prompt_embeds.to(dtype),
                   encoder_hidden_states_image=None if image_embeds is None else image_embeds.to(dtype))
    if not hooks and not call.block_hooks:
        return dit(**context, return_dict=False)[0]
    return wan_dit_forward(dit, **context, block_hooks=call.block_hooks, **hooks)
