"""The layers Wan's variant transformers share (S2V, Wan-Dancer, LongCat-Video, Video-As-Prompt, Animate-2): one 3-D
RoPE, one attention helper, the norms, and Wan's attention / block / head in Wan-AI's original module names.

Each variant computes in the precision its reference does: RoPE angles in float64 (Wan) or float32 (LongCat, the
`dtype` argument), the rotation in the wider of the input's and the tables' dtypes, norms in float32."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

# -- timestep embedding -------------------------------------------------------------------------------------


def sinusoidal(dim: int, position: torch.Tensor) -> torch.Tensor:
    """Wan's timestep embedding: [cos, sin] of position * 10000^(-i / (dim/2)), computed in float64."""
    half = dim // 2
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=position.device) / half)
    angles = position.to(torch.float64)[:, None] * freqs[None]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=1)


# -- 3-D RoPE ------------------------------------------------------------------------------------------------


def rope_axis_dims(head_dim: int) -> tuple[int, int, int]:
    """Wan's split of a head's channels over frame, height and width: d - 4 (d // 6), 2 (d // 6), 2 (d // 6)."""
    side = 2 * (head_dim // 6)
    return head_dim - 2 * side, side, side


def rope_angles(dim: int, positions: torch.Tensor, theta: float = 10000.0,
                dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """(n,) positions -> (n, dim / 2) angles position * theta^(-2i / dim), computed in `dtype`."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=dtype)[: dim // 2] / dim))
    return positions.to(dtype)[:, None] * inv[None]


def grid_table(frame_rows: torch.Tensor, height_rows: torch.Tensor, width_rows: torch.Tensor) -> torch.Tensor:
    """Per-axis rows (f, a), (h, b), (w, c) -> (f * h * w, a + b + c): each token (frame-major) its frame's, row's
    and column's entries."""
    f, h, w = frame_rows.shape[0], height_rows.shape[0], width_rows.shape[0]
    return torch.cat([frame_rows[:, None, None].expand(f, h, w, -1), height_rows[None, :, None].expand(f, h, w, -1),
                      width_rows[None, None, :].expand(f, h, w, -1)], dim=-1).reshape(f * h * w, -1)


def rope_grid_angles(head_dim: int, grid: tuple[int, int, int], frame0: int = 0, theta: float = 10000.0,
                     dtype: torch.dtype = torch.float64) -> torch.Tensor:
    """(f * h * w, head_dim / 2) angles of a token grid, frames numbered from `frame0`."""
    f, h, w = grid
    dims = rope_axis_dims(head_dim)
    return grid_table(*(rope_angles(d, torch.arange(n) + start, theta, dtype)
                        for d, n, start in zip(dims, (f, h, w), (frame0, 0, 0))))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, dtype: torch.dtype | None = None) -> torch.Tensor:
    """Rotate consecutive channel pairs of x (..., D) by angles given as cos / sin (broadcasting to (..., D / 2)):
    Wan's complex-number RoPE, returned in x's dtype. Each product is computed in the wider of x's and the tables'
    dtypes (diffusers' way); with `dtype`, x is converted to it first (Wan-AI's code: float64), which also sums
    the gradients in that dtype."""
    x1, x2 = (x if dtype is None else x.to(dtype)).unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack([x1 * cos - x2 * sin, x1 * sin + x2 * cos], dim=-1).flatten(-2).to(x.dtype)


def pair_tables(rope):
    """diffusers' Wan RoPE tables (cos and sin, (1, S, 1, D), each angle on a channel pair) -> one entry a pair."""
    cos, sin = rope
    return cos[..., 0::2], sin[..., 1::2]


# -- attention -----------------------------------------------------------------------------------------------


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """Scaled dot-product attention of (B, S, H, D) heads -> (B, S, H * D)."""
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=mask)
    return out.transpose(1, 2).flatten(2)


# -- norms ---------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    """Wan's RMSNorm: normalised in float32, scaled in the input's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class LayerNormFP32(nn.LayerNorm):
    """LayerNorm computed in float32 (weights too), returned in the input's dtype."""

    def forward(self, x):
        w = None if self.weight is None else self.weight.float()
        b = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).to(x.dtype)


def layer_norm(dim: int, eps: float = 1e-6, affine: bool = False) -> nn.LayerNorm:
    return nn.LayerNorm(dim, eps=eps, elementwise_affine=affine)


def modulate(norm: nn.Module, x: torch.Tensor, shift: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """norm(x) in float32, * (1 + scale) + shift, back in x's dtype (the adaLN of Wan's blocks)."""
    return (norm(x.float()) * (1 + scale) + shift).type_as(x)


def modulated_ffn(norm: nn.Module, ffn: nn.Module, x: torch.Tensor, shift, scale, gate) -> torch.Tensor:
    """A Wan block's feed-forward step: x + ffn(modulate(norm, x)) * gate, summed in float32."""
    return (x.float() + ffn(modulate(norm, x, shift, scale)).float() * gate).type_as(x)


# -- Wan's modules in Wan-AI's names ---------------------------------------------------------------------------


class WanAttention(nn.Module):
    """Wan's attention in its original names (q, k, v, o, norm_q, norm_k); with `image_input`, cross-attention
    also attends to the context's leading image tokens through k_img / v_img (norm_k_img)."""

    def __init__(self, dim: int, heads: int, eps: float = 1e-6, image_input: bool = False,
                 rope_dtype: torch.dtype | None = None):
        super().__init__()
        self.heads, self.rope_dtype = heads, rope_dtype  # rope_dtype: see `rotate`
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q, self.norm_k = RMSNorm(dim, eps), RMSNorm(dim, eps)
        if image_input:
            self.k_img, self.v_img = nn.Linear(dim, dim), nn.Linear(dim, dim)
            self.norm_k_img = RMSNorm(dim, eps)

    def split(self, t: torch.Tensor) -> torch.Tensor:
        return t.unflatten(2, (self.heads, -1))

    def qkv(self, x, context=None, rope=None):
        """q, k (normed; rotated by `rope`, a (cos, sin) pair) and v, as (B, S, heads, head_dim)."""
        context = x if context is None else context
        q, k = self.split(self.norm_q(self.q(x))), self.split(self.norm_k(self.k(context)))
        if rope is not None:
            q, k = rotate(q, *rope, self.rope_dtype), rotate(k, *rope, self.rope_dtype)
        return q, k, self.split(self.v(context))

    def forward(self, x, context=None, rope=None, image_tokens: int = 0):
        context = x if context is None else context
        img, context = (context[:, :image_tokens], context[:, image_tokens:]) if image_tokens else (None, context)
        q, k, v = self.qkv(x, context, rope)
        out = attend(q, k, v)
        if image_tokens and hasattr(self, "k_img"):
            out = out + attend(q, self.split(self.norm_k_img(self.k_img(img))), self.split(self.v_img(img)))
        return self.o(out)


class WanBlock(nn.Module):
    """Wan's DiT block's modules in the original names (self_attn, cross_attn, norm1-3, ffn.0 / ffn.2,
    modulation); the variants run it their way."""

    def __init__(self, dim: int, heads: int, ffn_dim: int, eps: float, image_input: bool = False,
                 rope_dtype: torch.dtype | None = None):
        super().__init__()
        self.self_attn = WanAttention(dim, heads, eps, rope_dtype=rope_dtype)
        self.cross_attn = WanAttention(dim, heads, eps, image_input)
        self.norm1, self.norm2, self.norm3 = layer_norm(dim, eps), layer_norm(dim, eps), layer_norm(dim, eps, True)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(ffn_dim, dim))
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim ** 0.5)


class Head(nn.Module):
    """Wan's output head (norm, head, modulation): tokens modulated by the time embedding, then projected."""

    def __init__(self, dim: int, out: int, eps: float):
        super().__init__()
        self.norm = layer_norm(dim, eps)
        self.head = nn.Linear(dim, out)
        self.modulation = nn.Parameter(torch.randn(1, 2, dim) / dim ** 0.5)

    def forward(self, x, t):
        shift, scale = (self.modulation + t[:, None]).chunk(2, dim=1)
        return self.head(self.norm(x) * (1 + scale) + shift)


class ImageMLP(nn.Module):
    """Wan's CLIP image projection (img_emb.proj.0-4)."""

    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.proj = nn.Sequential(nn.LayerNorm(cin), nn.Linear(cin, cin), nn.GELU(), nn.Linear(cin, cout),
                                  nn.LayerNorm(cout))

    def forward(self, x):
        return self.proj(x)


def add_wan_embeddings(module: nn.Module, dim: int, in_dim: int, text_dim: int, freq_dim: int, patch_size) -> None:
    """Wan's patch, text and time embeddings and time projection, under their original names."""
    module.patch_embedding = nn.Conv3d(in_dim, dim, kernel_size=tuple(patch_size), stride=tuple(patch_size))
    module.text_embedding = nn.Sequential(nn.Linear(text_dim, dim), nn.GELU(approximate="tanh"), nn.Linear(dim, dim))
    module.time_embedding = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
    module.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, dim * 6))


# -- diffusers' Wan block and head, step by step ----------------------------------------------------------------


def diffusers_inputs(dit, latents: torch.Tensor, condition: torch.Tensor | None):
    """The DiT's input (latents + the condition on channels, in the DiT's dtype), that dtype and the token grid."""
    dtype = dit.dtype if dit.dtype.is_floating_point else latents.dtype
    x = latents if condition is None else torch.cat([latents, condition.to(latents.dtype)], dim=1)
    x = x.to(dtype)
    pt, ph, pw = dit.config.patch_size
    return x, dtype, (x.shape[2] // pt, x.shape[3] // ph, x.shape[4] // pw)


def diffusers_conditions(dit, timestep: torch.Tensor, prompt_embeds: torch.Tensor, image_embeds, batch: int,
                         device, dtype):
    """diffusers' Wan condition embedder: the time embedding, the blocks' (B, 6, D) modulation, the context (the
    image tokens, if any, before the text's) and the number of image tokens."""
    t = timestep.to(device).reshape(-1).expand(batch)
    temb, tproj, context, image = dit.condition_embedder(
        t, prompt_embeds.to(dtype), None if image_embeds is None else image_embeds.to(dtype))
    tproj = tproj.unflatten(1, (6, -1))
    if image is not None:
        context = torch.cat([image, context], dim=1)
    return temb, tproj, context, 0 if image is None else image.shape[1]


def diffusers_self_qkv(attn, h: torch.Tensor, rope):
    """diffusers' Wan self-attention (`block.attn1`) projections of h: q, k (normed, rotated), v as (B, S, H, D)."""
    split = lambda t: t.unflatten(2, (attn.heads, -1))  # noqa: E731
    q = rotate(split(attn.norm_q(attn.to_q(h))), *rope)
    k = rotate(split(attn.norm_k(attn.to_k(h))), *rope)
    return q, k, split(attn.to_v(h))


def diffusers_output(dit, hidden: torch.Tensor, temb: torch.Tensor, grid) -> torch.Tensor:
    """diffusers' Wan head (norm_out, scale_shift_table, proj_out) and unpatchify: tokens -> (B, C, F, H, W)."""
    shift, scale = (dit.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
    return unpatchify(dit.proj_out(modulate(dit.norm_out, hidden, shift, scale)), grid, dit.config.patch_size)


def unpatchify(x: torch.Tensor, grid, patch_size) -> torch.Tensor:
    """(B, f * h * w, p_t * p_h * p_w * C) tokens -> (B, C, f * p_t, h * p_h, w * p_w)."""
    pt, ph, pw = patch_size
    x = x.reshape(x.shape[0], *grid, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return x.flatten(6, 7).flatten(4, 5).flatten(2, 3)


__all__ = ["Head", "ImageMLP", "LayerNormFP32", "RMSNorm", "WanAttention", "WanBlock", "add_wan_embeddings", "attend",
           "diffusers_conditions", "diffusers_inputs",
           "diffusers_output", "diffusers_self_qkv", "grid_table", "layer_norm", "modulate", "modulated_ffn",
           "pair_tables", "rope_angles", "rope_axis_dims", "rope_grid_angles", "rotate", "sinusoidal", "unpatchify"]
