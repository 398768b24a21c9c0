"""Qwen-Image's model_fn: one call of diffusers' `QwenImageTransformer2DModel` on packed 2x2 latent patches.

The call is assembled in a `QwenImageCall`: the noisy image's tokens and the prompt, then each feature of the call
adds its part at the forward's hook points (forward.py): images whose tokens follow the noisy image's (In-Context
control's, then the edit images'), a change of the text sequence once the image sequence is complete (EliGen's
entity prompts, RoPE positions and attention mask) and residuals after the blocks (the Blockwise ControlNet's). The
features' parts live in their own modules (`Feature.denoise`)."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ...core.checkpointing import set_gradient_checkpointing
from ...core.latents import pack_latents, unpack_latents
from .encoding import set_zero_cond_t
from .forward import transformer_forward


@dataclass
class QwenImageCall:
    """One denoiser call being assembled. `values`: the call's model_fn inputs; `tokens`: the noisy image's tokens
    (B, n, 64); `text` / `text_mask`: the prompt's embeddings and padding mask."""

    pipe: Any
    dit: Any
    values: Mapping[str, Any]
    tokens: torch.Tensor
    batch: int
    text: torch.Tensor
    text_mask: torch.Tensor | None
    # -- the forward's hook points -------------------------------------------------------------------------
    # latents (B, 16, h, w) whose tokens follow the noisy image's, each with its own RoPE frame: `conditions` first
    # (In-Context control's), then `references` (the edit images')
    conditions: list = field(default_factory=list)
    references: list = field(default_factory=list)
    # fn(call), run once the image sequence (`sequence`, `img_shapes`) is complete: may set `text`, `text_mask`,
    # `attention_mask` (B, 1, S, S) over [text, image] and `txt_freqs` (EliGen)
    sequence_hooks: list = field(default_factory=list)
    # fn(i, hidden) -> hidden, after DiT block i (the Blockwise ControlNet)
    block_residuals: list[Callable] = field(default_factory=list)
    sequence: torch.Tensor | None = None
    img_shapes: list | None = None
    attention_mask: torch.Tensor | None = None
    txt_freqs: torch.Tensor | None = None


def model_fn_qwen_image(dit, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor,
                        prompt_embeds_mask: torch.Tensor | None = None, *, pipe=None, features=None,
                        use_gradient_checkpointing: bool = False, use_gradient_checkpointing_offload: bool = False,
                        zero_cond_t: bool = False, **inputs: Any) -> torch.Tensor:
    """One denoiser call: latents (B, 16, h, w), timestep (B,) in [0, 1000] -> velocity (B, 16, h, w).

    The prompt mask is passed to the transformer so padded prompt tokens are never attended to: a batch
    of prompts of different lengths gives the same result as one prompt at a time. `zero_cond_t`
    (Qwen-Image-Edit-2511): the edit images' tokens are modulated at t=0, as diffusers does when the
    transformer's config says so (the config's setting holds either way). `features`: the pipeline's features
    (default: `QwenImagePipeline`'s); each one whose model_fn inputs are given (or whose own model is loaded in
    `pipe`) adds its part."""
    if features is None:  # a direct call: the family's pipeline's (through the registry: no import cycle)
        from ...core.family import get_family

        features = get_family("qwen_image").pipeline.features
    b, _, h, w = latents.shape
    call = QwenImageCall(pipe, dit, inputs, pack_latents(latents), b, prompt_embeds, prompt_embeds_mask)
    for feature in features:
        own = pipe is not None and any(pipe.models.get(slot) is not None for slot in feature.slots)
        if feature.in_call(inputs) or own:
            feature.denoise(pipe, call)
    tokens, shapes = call.tokens, [(1, h // 2, w // 2)]
    image_len = tokens.shape[1]
    for extra in [*call.conditions, *call.references]:  # one entry of img_shapes per image
        tokens = torch.cat([tokens, pack_latents(extra.to(tokens.dtype))], dim=1)
        shapes.append((1, extra.shape[-2] // 2, extra.shape[-1] // 2))
    call.sequence, call.img_shapes = tokens, [shapes] * b
    set_gradient_checkpointing(dit, use_gradient_checkpointing, use_gradient_checkpointing_offload)
    set_zero_cond_t(dit, zero_cond_t)
    timestep = timestep.to(device=latents.device, dtype=latents.dtype).expand(b)
    if not call.sequence_hooks and not call.block_residuals:
        out = dit(hidden_states=tokens, timestep=timestep / 1000, encoder_hidden_states=prompt_embeds,
                  encoder_hidden_states_mask=prompt_embeds_mask, img_shapes=call.img_shapes, return_dict=False)[0]
    else:
        for hook in call.sequence_hooks:
            hook(call)

        def block_residual(i, hidden):
            for residual in call.block_residuals:
                hidden = residual(i, hidden)
            return hidden

        out = transformer_forward(dit, tokens, timestep / 1000, call.text, call.text_mask, call.img_shapes,
                                  attention_mask=call.attention_mask, txt_freqs=call.txt_freqs,
                                  block_residual=block_residual if call.block_residuals else None,
                                  use_gradient_checkpointing=use_gradient_checkpointing,
                                  use_gradient_checkpointing_offload=use_gradient_checkpointing_offload)
    return unpack_latents(out[:, :image_len], h, w)
