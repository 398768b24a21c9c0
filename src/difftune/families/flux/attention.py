"""An attention processor for diffusers' FLUX.1 transformer that also takes a full [text, image] attention mask
(EliGen's regional attention) and the InstantX IP-Adapter's image keys and values. Without either it computes what
diffusers' `FluxAttnProcessor` does.

The IP-Adapter's attention follows the reference's `interact_with_ipadapter`: in a double block the image tokens'
queries (after the q-norm, before RoPE) attend to the block's image-prompt keys/values, and the result, times the
scale, is added to the image stream's attention output before `to_out`; in a single block every token's query
(after RoPE) does, before the output projection. Blocks are numbered double blocks first, then single blocks
(the IP-Adapter's 57 = 19 + 38 for FLUX.1).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor, _get_qkv_projections


def _ip_attention(query: torch.Tensor, ip_kv, scale: float) -> torch.Tensor:
    """query (B, S, H, D); ip_kv = (k, v) each (B, N, H, D) -> scale * attention (B, S, H*D)."""
    k, v = ip_kv
    out = F.scaled_dot_product_attention(query.transpose(1, 2), k.transpose(1, 2).to(query.dtype),
                                         v.transpose(1, 2).to(query.dtype))
    return scale * out.transpose(1, 2).flatten(2, 3)


class FluxFeatureAttnProcessor(FluxAttnProcessor):
    """diffusers' FLUX attention plus an optional attention mask and IP-Adapter keys/values for block `index`."""

    def __init__(self, index: int):
        super().__init__()
        self.index = index

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, image_rotary_emb=None,
                 ip_kv=None, ip_scale=1.0):
        ip = None if ip_kv is None else ip_kv[self.index]
        if attention_mask is None and ip is None:
            return super().__call__(attn, hidden_states, encoder_hidden_states, None, image_rotary_emb)
        query, key, value, encoder_query, encoder_key, encoder_value = _get_qkv_projections(
            attn, hidden_states, encoder_hidden_states)
        query = attn.norm_q(query.unflatten(-1, (-1, attn.head_dim)))
        key = attn.norm_k(key.unflatten(-1, (-1, attn.head_dim)))
        value = value.unflatten(-1, (-1, attn.head_dim))
        image_query = query
        if attn.added_kv_proj_dim is not None:
            encoder_query = attn.norm_added_q(encoder_query.unflatten(-1, (-1, attn.head_dim)))
            encoder_key = attn.norm_added_k(encoder_key.unflatten(-1, (-1, attn.head_dim)))
            encoder_value = encoder_value.unflatten(-1, (-1, attn.head_dim))
            query = torch.cat([encoder_query, query], dim=1)
            key = torch.cat([encoder_key, key], dim=1)
            value = torch.cat([encoder_value, value], dim=1)
        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)
        out = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, backend=self._attention_backend,
                                    parallel_config=self._parallel_config)
        out = out.flatten(2, 3).to(query.dtype)
        if encoder_hidden_states is None:  # a single block: [text, image] together, queries after RoPE
            return out if ip is None else out + _ip_attention(query, ip, ip_scale).to(out.dtype)
        n_txt = encoder_hidden_states.shape[1]
        encoder_out, out = out[:, :n_txt], out[:, n_txt:]
        if ip is not None:
            out = out + _ip_attention(image_query, ip, ip_scale).to(out.dtype)
        out = attn.to_out[1](attn.to_out[0](out.contiguous()))
        return out, attn.to_add_out(encoder_out.contiguous())


def use_feature_attention(dit) -> None:
    """Give every attention of the transformer a `FluxFeatureAttnProcessor` numbered in the IP-Adapter's order."""
    blocks = list(dit.transformer_blocks) + list(dit.single_transformer_blocks)
    for index, block in enumerate(blocks):
        processor = block.attn.processor
        if not (isinstance(processor, FluxFeatureAttnProcessor) and processor.index == index):
            block.attn.set_processor(FluxFeatureAttnProcessor(index))


__all__ = ["FluxFeatureAttnProcessor", "use_feature_attention"]
