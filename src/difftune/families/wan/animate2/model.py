"""Wan2.2-Animate-2's call of diffusers' `WanAnimate2Transformer3DModel` (`animate2_forward`: the reference pass,
then the clip's) and the dense in-context attention that lets it train on any device."""

from __future__ import annotations

import math

import torch
from diffusers.models.transformers.transformer_wan_animate_2 import (WanAnimate2AttnProcessor, WanAnimate2KVCache,
                                                                     _get_qkv_projections, rope_apply)

from ....errors import UserError
from ..layers import attend


class DenseInContextAttnProcessor(WanAnimate2AttnProcessor):
    """The generation pass's self-attention with a dense mask: every clip token attends to every clip token and to
    the reference video's tokens of the frame before its own (diffusers' block mask, for a clip that is the whole
    video). The reference pass is diffusers' own."""

    def __call__(self, attn, hidden_states, rotary_emb, grid_sizes, kv_cache, kv_cache_mode, rope_stride=1,
                 reference_rotary_emb=None, reference_grid_sizes=None, reference_rope_stride=1, attention_mask=None,
                 origin_latent_frames=None, origin_latent_hw=None):
        if kv_cache_mode != "cached":
            return super().__call__(attn, hidden_states, rotary_emb, grid_sizes, kv_cache, kv_cache_mode,
                                    rope_stride, reference_rotary_emb, reference_grid_sizes, reference_rope_stride,
                                    attention_mask, origin_latent_frames, origin_latent_hw)
        query, key, value = _get_qkv_projections(attn, hidden_states, None)
        query, key = attn.norm_q(query), attn.norm_k(key)
        query, key, value = (t.unflatten(2, (attn.heads, -1)) for t in (query, key, value))
        query = rope_apply(query, grid_sizes, rotary_emb, rope_stride).type_as(value)
        key = rope_apply(key, grid_sizes, rotary_emb, rope_stride).type_as(value)
        key_ref, value_ref = kv_cache.get()
        key_ref = rope_apply(key_ref, reference_grid_sizes, reference_rotary_emb, reference_rope_stride).type_as(value)
        f, h, w = grid_sizes[0].tolist()
        rf, rh, rw = reference_grid_sizes[0].tolist()
        n, n_ref = f * h * w, rf * rh * rw
        frame = torch.arange(n, device=query.device) // (h * w)
        ref_frame = torch.arange(n_ref, device=query.device) // (rh * rw) + 1
        mask = torch.cat([torch.ones(n, n, dtype=torch.bool, device=query.device),
                          frame[:, None] == ref_frame[None]], dim=1)
        keys = torch.cat([key[:, :n], key_ref[:, :n_ref]], dim=1)
        values = torch.cat([value[:, :n], value_ref[:, :n_ref]], dim=1)
        out = torch.cat([attend(query[:, :n], keys, values, mask), query[:, n:].flatten(2)], dim=1).type_as(query)
        return attn.to_out[1](attn.to_out[0](out))


def use_dense_attention(dit) -> None:
    """Switch the blocks' self-attention to `DenseInContextAttnProcessor` (once)."""
    for block in dit.blocks:
        if not isinstance(block.self_attn.processor, DenseInContextAttnProcessor):
            block.self_attn.set_processor(DenseInContextAttnProcessor())


def use_flex_attention(dit) -> None:
    """Back to diffusers' flex-attention processor (CUDA; compiled on first use)."""
    for block in dit.blocks:
        if isinstance(block.self_attn.processor, DenseInContextAttnProcessor):
            block.self_attn.set_processor(WanAnimate2AttnProcessor())


def animate2_forward(dit, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor,
                     image_embeds: torch.Tensor | None, condition: torch.Tensor,
                     animate2_condition_latents: torch.Tensor, animate2_condition_y: torch.Tensor,
                     animate2_prompt_embeds: torch.Tensor, animate2_reference_image_embeds: torch.Tensor | None,
                     unconditional: bool = False, dense: bool = True,
                     reference_timestep: torch.Tensor | None = None) -> torch.Tensor:
    """model_fn's part: the reference pass, then the clip's (B, 16, F, h, w) -> (B, 16, F, h, w). `dense`: the
    dense in-context attention (any device, with gradients); else diffusers' flex path. `reference_timestep`: the
    reference pass's timestep (sampling: the first step's, as the reference computes its KV cache once; training:
    the sample's own)."""
    if condition is None or animate2_condition_latents is None:
        raise UserError("Wan-Animate-2 needs animate2_reference_image and animate2_reference_video")
    use_dense_attention(dit) if dense else use_flex_attention(dit)
    b, _, f, h, w = latents.shape
    rf = animate2_condition_latents.shape[2]
    p_t, p_h, p_w = dit.config.patch_size
    grid = torch.tensor([[f // p_t, h // p_h, w // p_w]] * b)
    ref_grid = torch.tensor([[rf // p_t, h // p_h, w // p_w]] * b)
    dtype = dit.patch_embedding.weight.dtype
    as_list = lambda x: [u.to(dtype) for u in x.unbind(0)]  # noqa: E731
    t = timestep.to(latents.device).reshape(-1).expand(b)
    t_ref = t if reference_timestep is None else reference_timestep.to(latents.device).reshape(-1).expand(b)
    cache = WanAnimate2KVCache(len(dit.blocks))
    dit(hidden_states=as_list(animate2_condition_latents), timestep=t_ref,
        encoder_hidden_states=as_list(animate2_prompt_embeds), condition_latents=as_list(animate2_condition_y),
        kv_cache=cache, kv_cache_mode="extract", seq_len=int(math.prod(ref_grid[0].tolist())),
        encoder_hidden_states_image=None if animate2_reference_image_embeds is None else
        animate2_reference_image_embeds.to(dtype), offset_grid_sizes=grid)
    # diffusers' block mask is sized from the clip's pixel frames and area: 4 per latent frame after the first (the
    # leading latent frame is the reference image's), 256 pixels per token
    origin_len = (f - 2) * 4 + 1
    origin_area = [w * 8, h * 8]
    mask_key = (origin_len // 4 + 1, origin_area[0] * origin_area[1] // 256)
    if dense:
        dit.block_masks.setdefault(mask_key, None)  # unused by the dense attention: never built
    elif dit.block_masks.get(mask_key, 0) is None:
        del dit.block_masks[mask_key]
    out = dit(hidden_states=as_list(latents), timestep=t, encoder_hidden_states=as_list(prompt_embeds),
              condition_latents=as_list(condition), kv_cache=cache, kv_cache_mode="cached",
              seq_len=int(math.prod(grid[0].tolist())),
              encoder_hidden_states_image=None if image_embeds is None else image_embeds.to(dtype),
              reference_grid_sizes=ref_grid, origin_len=origin_len, origin_area=origin_area,
              is_uncondtion=unconditional, return_dict=False)[0]
    return torch.stack(out)


__all__ = ["DenseInContextAttnProcessor", "animate2_forward", "use_dense_attention", "use_flex_attention"]
