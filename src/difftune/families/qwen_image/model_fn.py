"""Qwen-Image's model_fn: one call of diffusers' `QwenImageTransformer2DModel` on packed 2x2 latent patches."""

from __future__ import annotations

from typing import Any

import torch

from ...core.checkpointing import set_gradient_checkpointing
from ...core.latents import pack_latents, unpack_latents
from .context import append_context
from .edit_plus import edit_latent_batches
from .encoding import set_zero_cond_t
from .eligen import ENTITY_OUTPUTS
from .forward import controlled_forward


def model_fn_qwen_image(dit, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor,
                        prompt_embeds_mask: torch.Tensor | None = None, edit_latents=None,
                        use_gradient_checkpointing: bool = False, use_gradient_checkpointing_offload: bool = False,
                        zero_cond_t: bool = False, context_latents: torch.Tensor | None = None,
                        blockwise_controlnet=None, blockwise_controlnet_conditioning: torch.Tensor | None = None,
                        entity_prompt_embeds: torch.Tensor | None = None, **more: Any) -> torch.Tensor:
    """One denoiser call: latents (B, 16, h, w), timestep (B,) in [0, 1000] -> velocity (B, 16, h, w).

    The prompt mask is passed to the transformer so padded prompt tokens are never attended to: a batch
    of prompts of different lengths gives the same result as one prompt at a time. `zero_cond_t`
    (Qwen-Image-Edit-2511): the edit images' tokens are modulated at t=0, as diffusers does when the
    transformer's config says so (the config's setting holds either way). In-Context control's
    `context_latents`, EliGen's entity values and the Blockwise ControlNet: context.py, eligen.py, controlnet.py.
    """
    b, _, h, w = latents.shape
    tokens = pack_latents(latents)
    image_len = tokens.shape[1]
    shapes = [(1, h // 2, w // 2)]
    tokens, shapes = append_context(tokens, shapes, context_latents)  # before edit images, as the reference
    for e in edit_latent_batches(edit_latents, b, tokens):  # one entry of img_shapes per edit image
        tokens = torch.cat([tokens, pack_latents(e)], dim=1)
        shapes.append((1, e.shape[-2] // 2, e.shape[-1] // 2))
    set_gradient_checkpointing(dit, use_gradient_checkpointing, use_gradient_checkpointing_offload)
    set_zero_cond_t(dit, zero_cond_t)
    timestep = timestep.to(device=latents.device, dtype=latents.dtype).expand(b)
    if entity_prompt_embeds is None and blockwise_controlnet_conditioning is None:
        out = dit(hidden_states=tokens, timestep=timestep / 1000, encoder_hidden_states=prompt_embeds,
                  encoder_hidden_states_mask=prompt_embeds_mask, img_shapes=[shapes] * b, return_dict=False)[0]
    else:
        entity = None if entity_prompt_embeds is None else {
            "entity_prompt_embeds": entity_prompt_embeds, **{k: more.get(k) for k in ENTITY_OUTPUTS[1:]}}
        out = controlled_forward(dit, tokens, timestep / 1000, prompt_embeds, prompt_embeds_mask, [shapes] * b,
                                 image_len, blockwise_controlnet=blockwise_controlnet,
                                 blockwise_controlnet_conditioning=blockwise_controlnet_conditioning, entity=entity,
                                 use_gradient_checkpointing=use_gradient_checkpointing,
                                 use_gradient_checkpointing_offload=use_gradient_checkpointing_offload)
    return unpack_latents(out[:, :image_len], h, w)
