"""Wan's model_fn: one call of diffusers' `WanTransformer3DModel` on (B, C, F, H, W) latents, with what each variant
adds to it (dit_forward.py has the hook points): the Fun control latents and reference tokens, the camera adapter's
residual, the motion controller's residual, VACE's hints, Animate's pose residual and face adapter."""

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


def model_fn_wan(dit, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor,
                 image_embeds: torch.Tensor | None = None, condition: torch.Tensor | None = None,
                 first_frame_latents: torch.Tensor | None = None, end_image_embeds: torch.Tensor | None = None, *,
                 control_latents: torch.Tensor | None = None, reference_latents: torch.Tensor | None = None,
                 reference_image_embeds: torch.Tensor | None = None,
                 control_camera_latents: torch.Tensor | None = None, camera_image_latents: torch.Tensor | None = None,
                 motion_residual: torch.Tensor | None = None, vace=None, vace_context: torch.Tensor | None = None,
                 vace_scale=1.0, animate_adapter=None, pose_latents: torch.Tensor | None = None,
                 face_motion: torch.Tensor | None = None, use_gradient_checkpointing: bool = False,
                 use_gradient_checkpointing_offload: bool = False, **_: Any) -> torch.Tensor:
    """One denoiser call: latents (B, C, F, h, w), timestep (B,) in [0, 1000] -> velocity (B, C, F, h, w).

    I2V DiTs (in_channels > out_channels) take `condition` on channels and, Wan2.1 I2V 14B, `image_embeds`;
    with `first_frame_latents` (TI2V-5B) the first latent frame is replaced by them at timestep 0. The end image's
    CLIP tokens are used by a DiT with image position embeddings for two images (FLF2V) only. Fun-Control DiTs take
    `control_latents` before the image condition, camera DiTs the camera latents through their adapter; VACE's
    hints, Animate's face adapter and the motion controller's residual join inside the blocks."""
    from .animate import animate_inputs
    from .camera import camera_dit_inputs
    from .dit_forward import wan_dit_forward
    from .fun_control import fun_control_dit_inputs, reference_tokens

    b = latents.shape[0]
    dtype = dit.dtype if dit.dtype.is_floating_point else latents.dtype
    for module in (dit, vace, animate_adapter):
        if module is not None:
            set_gradient_checkpointing(module, use_gradient_checkpointing, use_gradient_checkpointing_offload)
    x = latents
    t = timestep.to(latents.device).expand(b)
    if first_frame_latents is not None:
        x = torch.cat([first_frame_latents.to(x.dtype), x[:, :, 1:]], dim=2)
        t = first_frame_timesteps(t, x)
    hooks: dict[str, Any] = {}
    if control_latents is not None:
        x, image_embeds = fun_control_dit_inputs(dit, x, control_latents, condition, image_embeds,
                                                 reference_image_embeds)
    elif control_camera_latents is not None:
        x, hooks["patch_residual"] = camera_dit_inputs(dit, x, control_camera_latents, camera_image_latents,
                                                       condition)
        if dit.config.image_dim is not None and image_embeds is None:
            raise UserError("this camera DiT needs the CLIP image embedding of the first frame: load the image "
                            "encoder too")
        image_embeds = image_embeds if dit.config.image_dim is not None else None
    else:
        if reference_image_embeds is not None and dit.config.image_dim is not None:
            image_embeds = reference_image_embeds  # a Fun reference image's CLIP stands in for the input image's
        x, image_embeds = _image_inputs(dit, x, condition, image_embeds, end_image_embeds)
    if reference_latents is not None:
        hooks["prefix_tokens"] = reference_tokens(dit, reference_latents)
    if motion_residual is not None:
        hooks["timestep_proj_residual"] = motion_residual
    block_hooks = []
    if vace_context is not None:
        if vace is None:
            raise UserError("VACE inputs were given but no VACE model is loaded (a Wan VACE file holds one)")
        block_hooks.append(vace.block_hook(vace_context, vace_scale))
    if pose_latents is not None or face_motion is not None:
        residual, hook = animate_inputs(animate_adapter, pose_latents, face_motion)
        hooks["patch_residual"] = residual
        block_hooks.append(hook)
    context = dict(hidden_states=x.to(dtype), timestep=t, encoder_hidden_states=prompt_embeds.to(dtype),
                   encoder_hidden_states_image=None if image_embeds is None else image_embeds.to(dtype))
    if not hooks and not block_hooks:
        return dit(**context, return_dict=False)[0]
    return wan_dit_forward(dit, **context, block_hooks=block_hooks, **hooks)
