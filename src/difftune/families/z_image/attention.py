"""Z-Image's attention with the queries and keys normed and rotated together.

diffusers' `ZSingleStreamAttnProcessor` runs the q-norm, the k-norm and RoPE on the queries and the keys apart: 16
operators per attention (twice per block with gradient checkpointing) and their backward. Here the keys are put
beside the queries as more heads (one `cat`), so one RMSNorm (the two norms' weights side by side) and one RoPE
cover both, and one `unbind` splits them again. Each element goes through the same operations in the same order and
dtypes as in diffusers' processor (the norms reduce each head's row alone), so the output is the same; the backward
differs only in the order of the norms' weight-gradient sums. Any other set-up (no or other norms, norms that differ
in eps or dtype) runs diffusers' own code.
"""

from __future__ import annotations

import torch
from diffusers.models.attention_dispatch import dispatch_attention_fn
from diffusers.models.normalization import RMSNorm
from diffusers.models.transformers.transformer_z_image import ZSingleStreamAttnProcessor

JOINT_QK = True  # off: diffusers' processor stays (benchmarks/host_overhead.py's "before")
_DIFFUSERS_MODULES = ("diffusers.models.transformers.transformer_z_image",
                      "diffusers.models.controlnets.controlnet_z_image")
_FREQS: list = []  # (freqs_cis, its broadcast view), the latest first


def _joint_norms(attn) -> bool:
    q, k = attn.norm_q, attn.norm_k
    if type(q) is not RMSNorm or type(k) is not RMSNorm or q.eps != k.eps or q.bias is not None \
            or k.bias is not None:
        return False
    if q.weight is None or k.weight is None:
        return q.weight is None and k.weight is None
    return q.weight.dtype == k.weight.dtype and q.weight.shape == k.weight.shape


class JointQKAttnProcessor(ZSingleStreamAttnProcessor):
    """`ZSingleStreamAttnProcessor` with one norm and one RoPE for the queries and keys together."""

    def __init__(self):
        super().__init__()
        self._weight = None  # (frozen q weight, frozen k weight, their (2, 1, D) stack, their versions)

    def _stacked_weight(self, attn):
        wq, wk = attn.norm_q.weight, attn.norm_k.weight
        if wq.requires_grad or wk.requires_grad or torch.compiler.is_compiling():
            return torch.stack([wq, wk]).unsqueeze(1)
        cached = self._weight
        if cached is None or cached[0] is not wq or cached[1] is not wk or cached[2].device != wq.device \
                or cached[3] != (wq._version, wk._version):
            cached = self._weight = (wq, wk, torch.stack([wq, wk]).unsqueeze(1), (wq._version, wk._version))
        return cached[2]

    @staticmethod
    def _freqs_broadcast(freqs_cis):
        """freqs_cis (B, S, D/2) as (B, S, 1, 1, D/2), made once for the blocks of a forward that share it."""
        if torch.compiler.is_compiling():
            return freqs_cis[:, :, None, None]
        for given, view in _FREQS:
            if given is freqs_cis:
                return view
        view = freqs_cis[:, :, None, None]
        _FREQS.insert(0, (freqs_cis, view))
        del _FREQS[4:]  # a forward has up to 4 (image, prompt, SigLIP, unified)
        return view

    def __call__(self, attn, hidden_states, encoder_hidden_states=None, attention_mask=None, freqs_cis=None):
        if encoder_hidden_states is not None or not _joint_norms(attn):
            return super().__call__(attn, hidden_states, encoder_hidden_states, attention_mask, freqs_cis)
        query, key = attn.to_q(hidden_states), attn.to_k(hidden_states)
        value = attn.to_v(hidden_states).unflatten(-1, (attn.heads, -1))
        # (B, S, 2, heads, head_dim): the keys as the second half
        qk = torch.cat([query, key], dim=-1).unflatten(-1, (2, attn.heads, -1))
        norm = attn.norm_q
        variance = qk.to(torch.float32).pow(2).mean(-1, keepdim=True)  # diffusers' RMSNorm, its ops in its order
        qk = qk * torch.rsqrt(variance + norm.eps)
        if norm.weight is not None:
            if norm.weight.dtype in (torch.float16, torch.bfloat16):
                qk = qk.to(norm.weight.dtype)
            qk = qk * self._stacked_weight(attn)
        else:
            qk = qk.to(query.dtype)
        if freqs_cis is not None:  # diffusers' complex RoPE, the freqs broadcast over both halves' heads
            with torch.amp.autocast("cuda", enabled=False):
                x = torch.view_as_complex(qk.float().reshape(*qk.shape[:-1], -1, 2))
                qk = torch.view_as_real(x * self._freqs_broadcast(freqs_cis)).flatten(4).type_as(qk)
        query, key = qk.unbind(2)
        if attention_mask is not None and attention_mask.ndim == 2:
            attention_mask = attention_mask[:, None, None, :]
        hidden_states = dispatch_attention_fn(query, key, value, attn_mask=attention_mask, dropout_p=0.0,
                                              is_causal=False, backend=self._attention_backend,
                                              parallel_config=self._parallel_config)
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)
        output = attn.to_out[0](hidden_states)
        if len(attn.to_out) > 1:  # dropout
            output = attn.to_out[1](output)
        return output


def use_joint_qk(*models) -> None:
    """Give each Z-Image attention of `models` (the DiT, a Fun ControlNet) the joint processor, once per model."""
    if not JOINT_QK:
        return
    for model in models:
        if model is None or model.__dict__.get("_difftune_joint_qk"):
            continue
        for module in model.modules():
            processor = getattr(module, "processor", None)
            if type(processor).__name__ == "ZSingleStreamAttnProcessor" \
                    and type(processor).__module__ in _DIFFUSERS_MODULES:
                module.set_processor(JointQKAttnProcessor())
        model._difftune_joint_qk = True
