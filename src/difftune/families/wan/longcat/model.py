"""LongCat-Video's DiT, `LongCatVideoTransformer3DModel`, and its call (`model_fn_longcat`).

diffusers has no LongCat-Video transformer; it is written here from the published architecture (the reference's
`diffsynth/models/longcat_video_dit.py`), in the released `dit/` files' key names (`x_embedder.proj`,
`blocks.N.attn.qkv`, `blocks.N.cross_attn.kv_linear`, `blocks.N.ffn.w1`, `final_layer.*`), with the released
config.json's class name and parameter names. RoPE, attention and norms are the family's (`..layers`)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from ....core.checkpointing import gradient_checkpoint_forward
from ..layers import LayerNormFP32, RMSNorm, attend, modulate, rope_grid_angles, rotate, unpatchify


def _call32(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` as a float32 result. The module is called (not its weights read), so an injected LoRA counts;
    it computes in its own dtype (the reference runs these under float32 autocast: equal in float32)."""
    dtype = next(module.parameters()).dtype
    return module(x.to(dtype if dtype.is_floating_point else x.dtype)).float()


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.q_norm, self.k_norm = RMSNorm(self.head_dim), RMSNorm(self.head_dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, grid, num_cond: int = 0):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        # LongCat's RoPE angles are float32 (Wan's float64)
        angles = rope_grid_angles(self.head_dim, grid, dtype=torch.float32)
        cos, sin = (t.to(x.device)[None, None] for t in (angles.cos(), angles.sin()))
        q, k = (rotate(t, cos, sin).transpose(1, 2) for t in (q, k))
        v = v.transpose(1, 2)
        if num_cond:
            # the prefix frames attend among themselves only; the rest attend to every token
            cut = num_cond * (n // grid[0])
            return self.proj(torch.cat([attend(q[:, :cut], k[:, :cut], v[:, :cut]), attend(q[:, cut:], k, v)], dim=1))
        return self.proj(attend(q, k, v))


class CrossAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q_linear, self.kv_linear, self.proj = nn.Linear(dim, dim), nn.Linear(dim, dim * 2), nn.Linear(dim, dim)
        self.q_norm, self.k_norm = RMSNorm(self.head_dim), RMSNorm(self.head_dim)

    def forward(self, x, context, num_cond_tokens: int = 0):
        b, n, c = x.shape
        x_in = x[:, num_cond_tokens:]
        q = self.q_norm(self.q_linear(x_in).view(b, -1, self.heads, self.head_dim))
        k, v = self.kv_linear(context).view(b, -1, 2, self.heads, self.head_dim).unbind(2)
        out = self.proj(attend(q, self.k_norm(k), v))
        return torch.cat([out.new_zeros(b, num_cond_tokens, c), out], dim=1) if num_cond_tokens else out


def swiglu_width(hidden: int, multiple_of: int = 256) -> int:
    """The SwiGLU's inner width for a nominal `hidden`: two thirds of it, rounded up to a multiple."""
    hidden = int(2 * hidden / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, multiple_of: int = 256):
        super().__init__()
        hidden = swiglu_width(hidden, multiple_of)
        self.w1, self.w2, self.w3 = nn.Linear(dim, hidden, bias=False), nn.Linear(hidden, dim, bias=False), \
            nn.Linear(dim, hidden, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class LongCatBlock(nn.Module):
    def __init__(self, dim: int, heads: int, mlp_ratio: float, tembed: int):
        super().__init__()
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(tembed, 6 * dim))  # noqa: N815 - file names
        self.mod_norm_attn = LayerNormFP32(dim, eps=1e-6, elementwise_affine=False)
        self.mod_norm_ffn = LayerNormFP32(dim, eps=1e-6, elementwise_affine=False)
        self.pre_crs_attn_norm = LayerNormFP32(dim, eps=1e-6, elementwise_affine=True)
        self.attn = SelfAttention(dim, heads)
        self.cross_attn = CrossAttention(dim, heads)
        self.ffn = SwiGLU(dim, int(dim * mlp_ratio))

    def forward(self, x, context, t, grid, num_cond: int = 0):
        b, n, c = x.shape
        frames = grid[0]
        mods = _call32(self.adaLN_modulation, t).unsqueeze(2).chunk(6, dim=-1)
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = mods  # (B, T, 1, C) each, fp32
        dtype = x.dtype
        h = modulate(self.mod_norm_attn, x.view(b, frames, -1, c), shift_msa, scale_msa).view(b, n, c)
        h = self.attn(h, grid, num_cond)
        x = (x + (gate_msa * h.view(b, frames, -1, c)).view(b, n, c)).to(dtype)
        x = x + self.cross_attn(self.pre_crs_attn_norm(x), context, num_cond * (n // frames))
        h = modulate(self.mod_norm_ffn, x.view(b, frames, -1, c), shift_mlp, scale_mlp).view(b, n, c)
        h = self.ffn(h)
        return (x + (gate_mlp * h.view(b, frames, -1, c)).view(b, n, c)).to(dtype)


class _PatchEmbed(nn.Module):
    def __init__(self, patch, cin, dim):
        super().__init__()
        self.proj = nn.Conv3d(cin, dim, kernel_size=tuple(patch), stride=tuple(patch))


class _TimestepEmbedder(nn.Module):
    def __init__(self, tembed: int, freq: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(freq, tembed), nn.SiLU(), nn.Linear(tembed, tembed))


class _CaptionEmbedder(nn.Module):
    def __init__(self, cin: int, dim: int):
        super().__init__()
        self.y_proj = nn.Sequential(nn.Linear(cin, dim), nn.GELU(approximate="tanh"), nn.Linear(dim, dim))


class _FinalLayer(nn.Module):
    def __init__(self, dim: int, patch: int, cout: int, tembed: int):
        super().__init__()
        self.norm_final = LayerNormFP32(dim, elementwise_affine=False, eps=1e-6)
        self.linear = nn.Linear(dim, patch * cout)
        self.adaLN_modulation = nn.Sequential(nn.SiLU(), nn.Linear(tembed, 2 * dim))  # noqa: N815


def timestep_frequencies(t: torch.Tensor, dim: int, max_period: float = 10000.0) -> torch.Tensor:
    """[cos, sin] of t * exp(-ln(max_period) i / (dim / 2)), float32 (LongCat's, not Wan's, embedding)."""
    half = dim // 2
    freqs = torch.exp(-math.log(max_period) * torch.arange(half, dtype=torch.float32, device=t.device) / half)
    args = t.float()[:, None] * freqs[None]
    out = torch.cat([torch.cos(args), torch.sin(args)], dim=-1)
    return torch.cat([out, torch.zeros_like(out[:, :1])], dim=-1) if dim % 2 else out


class LongCatVideoTransformer3DModel(ModelMixin, ConfigMixin):
    """LongCat-Video's DiT in the released file's key names and config names."""

    _supports_gradient_checkpointing = True
    _no_split_modules = ["LongCatBlock"]

    @register_to_config
    def __init__(self, in_channels: int = 16, out_channels: int = 16, hidden_size: int = 4096, depth: int = 48,
                 num_heads: int = 32, caption_channels: int = 4096, mlp_ratio: float = 4,
                 adaln_tembed_dim: int = 512, frequency_embedding_size: int = 256, patch_size=(1, 2, 2),
                 text_tokens_zero_pad: bool = True):
        super().__init__()
        self.x_embedder = _PatchEmbed(patch_size, in_channels, hidden_size)
        self.t_embedder = _TimestepEmbedder(adaln_tembed_dim, frequency_embedding_size)
        self.y_embedder = _CaptionEmbedder(caption_channels, hidden_size)
        self.blocks = nn.ModuleList([LongCatBlock(hidden_size, num_heads, mlp_ratio, adaln_tembed_dim)
                                     for _ in range(depth)])
        self.final_layer = _FinalLayer(hidden_size, math.prod(patch_size), out_channels, adaln_tembed_dim)
        self.gradient_checkpointing = False

    def embed_time(self, timestep: torch.Tensor) -> torch.Tensor:
        """(B, T) timesteps -> (B, T, adaln_tembed_dim), float32."""
        f = timestep_frequencies(timestep.flatten(), self.config.frequency_embedding_size)
        return _call32(self.t_embedder.mlp, f).reshape(*timestep.shape, -1)


def model_fn_longcat(dit: LongCatVideoTransformer3DModel, latents: torch.Tensor, timestep: torch.Tensor,
                     prompt_embeds: torch.Tensor, longcat_latents: torch.Tensor | None = None,
                     use_gradient_checkpointing: bool = False, use_gradient_checkpointing_offload: bool = False,
                     **_: Any) -> torch.Tensor:
    """One LongCat-Video call: latents (B, 16, F, h, w), timestep (B,) -> velocity in Wan's sign convention (the
    DiT's output negated), float32. With `longcat_latents` (a clip's first frames, video continuation) those
    frames are put in front at timestep 0."""
    c = dit.config
    dtype = dit.dtype if dit.dtype.is_floating_point else latents.dtype
    num_cond = 0
    x = latents
    if longcat_latents is not None:
        num_cond = longcat_latents.shape[2]
        x = torch.cat([longcat_latents.to(x.dtype), x[:, :, num_cond:]], dim=2)
    b, _, frames, height, width = x.shape
    pt, ph, pw = c.patch_size
    grid = (frames // pt, height // ph, width // pw)
    t = timestep.to(x.device).reshape(-1).expand(b)[:, None].expand(b, grid[0]).clone()
    t[:, :num_cond] = 0
    temb = dit.embed_time(t)  # (B, T, C_t) fp32
    hidden = dit.x_embedder.proj(x.to(dtype)).flatten(2).transpose(1, 2)
    # text: projected, then the tokens past each prompt (zero embeddings) zeroed
    keep = prompt_embeds.ne(0).any(dim=-1)
    y = dit.y_embedder.y_proj(prompt_embeds.to(dtype))
    if c.text_tokens_zero_pad:
        y = y * keep[..., None].to(y.dtype)
    for block in dit.blocks:
        hidden = gradient_checkpoint_forward(block, use_gradient_checkpointing, use_gradient_checkpointing_offload,
                                             hidden, y, temb, grid, num_cond)
    final = dit.final_layer
    shift, scale = _call32(final.adaLN_modulation, temb).unsqueeze(2).chunk(2, dim=-1)
    n = hidden.shape[1]
    out = modulate(final.norm_final, hidden.view(b, grid[0], -1, c.hidden_size), shift, scale)
    out = _call32(final.linear, out.view(b, n, -1))
    return -unpatchify(out, grid, c.patch_size).float()


__all__ = ["LongCatBlock", "LongCatVideoTransformer3DModel", "model_fn_longcat", "swiglu_width",
           "timestep_frequencies"]
