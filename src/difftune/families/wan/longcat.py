"""LongCat-Video (meituan-longcat/LongCat-Video): its own text-to-video DiT over Wan2.1's VAE latents and UMT5
prompt embeddings, as the reference's `lora|full/LongCat-Video.sh` train it.

diffusers has no LongCat-Video transformer; `LongCatVideoTransformer3DModel` is written here from the published
architecture (the reference's `diffsynth/models/longcat_video_dit.py`), in the released `dit/` files' key names
(`x_embedder.proj`, `blocks.N.attn.qkv`, `blocks.N.cross_attn.kv_linear`, `blocks.N.ffn.w1`, `final_layer.*`),
so the reference's LoRA targets (`attn.qkv,attn.proj,cross_attn.q_linear,...,ffn.w3`) name its modules as they
are. It carries the released config.json's class name and parameter names.

What differs from Wan's DiT: per-frame timesteps (a video-continuation prefix of `longcat_latents` frames at
timestep 0), SwiGLU feed-forward, fused qkv with per-head RMSNorm, LLaMA-style (interleaved-pair) 3-D RoPE,
fp32 modulation, text tokens past the prompt zeroed after their projection, and a velocity of the opposite sign
(`model_fn` negates it, as the reference's does).
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from ...core.checkpointing import gradient_checkpoint_forward
from ...core.features import Feature
from ...core.units import PipelineUnit
from ...errors import UserError
from ...models.detect import ComponentSpec
from .units import (WanInputVideoEmbedder, WanNoiseInitializer, WanPromptEmbedder, WanShapeChecker, vae_encode,
                    video_tensor)
from .variant import WanVariantPipeline, dit_class

FEATURE = "longcat"
# the reference's LoRA targets for LongCat-Video (lora/LongCat-Video.sh), which are this model's module names
LORA_TARGET_MODULES = ("adaLN_modulation.1,attn.qkv,attn.proj,cross_attn.q_linear,cross_attn.kv_linear,"
                       "cross_attn.proj,ffn.w1,ffn.w2,ffn.w3")


class RMSNormFP32(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


class LayerNormFP32(nn.LayerNorm):
    def forward(self, x):
        w = None if self.weight is None else self.weight.float()
        b = None if self.bias is None else self.bias.float()
        return F.layer_norm(x.float(), self.normalized_shape, w, b, self.eps).to(x.dtype)


def _call32(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """`module(x)` as a float32 result. The module is called (not its weights read), so an injected LoRA counts;
    it computes in its own dtype (the reference runs these under float32 autocast: equal in float32)."""
    dtype = next(module.parameters()).dtype
    return module(x.to(dtype if dtype.is_floating_point else x.dtype)).float()


def _modulate(norm, x, shift, scale):
    """norm(x) in fp32, * (1 + scale) + shift, back to x's dtype; x (B, T, tokens per frame, C)."""
    return (norm(x.float()) * (scale + 1) + shift).to(x.dtype)


def rope_cos_sin(head_dim: int, grid: tuple[int, int, int], base: float = 10000.0):
    """LongCat's 3-D RoPE tables (tokens, head_dim): frame / height / width take head_dim - 4 (head_dim // 6),
    2 (head_dim // 6), 2 (head_dim // 6) channels, each frequency repeated on a channel pair."""
    t, h, w = grid
    dims = (head_dim - 4 * (head_dim // 6), 2 * (head_dim // 6), 2 * (head_dim // 6))
    axes = []
    for n, d in zip((t, h, w), dims):
        inv = 1.0 / (base ** (torch.arange(0, d, 2)[: d // 2].float() / d))
        axes.append(torch.repeat_interleave(torch.arange(n, dtype=torch.float32)[:, None] * inv[None], 2, dim=1))
    ft = axes[0][:, None, None].expand(t, h, w, -1)
    fh = axes[1][None, :, None].expand(t, h, w, -1)
    fw = axes[2][None, None, :].expand(t, h, w, -1)
    freqs = torch.cat([ft, fh, fw], dim=-1).reshape(t * h * w, head_dim)
    return freqs.cos(), freqs.sin()


def _rotate_pairs(x):
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)


def _sdpa(q, k, v):  # (B, H, S, D)
    return F.scaled_dot_product_attention(q, k, v)


class SelfAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.qkv = nn.Linear(dim, dim * 3)
        self.q_norm, self.k_norm = RMSNormFP32(self.head_dim), RMSNormFP32(self.head_dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x, grid, num_cond: int = 0):
        b, n, c = x.shape
        q, k, v = self.qkv(x).view(b, n, 3, self.heads, self.head_dim).permute(2, 0, 3, 1, 4).unbind(0)
        q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = (t.to(x.device)[None, None] for t in rope_cos_sin(self.head_dim, grid))
        q = (q.float() * cos + _rotate_pairs(q.float()) * sin).type_as(q)
        k = (k.float() * cos + _rotate_pairs(k.float()) * sin).type_as(k)
        if num_cond:
            # the prefix frames attend among themselves only; the rest attend to every token
            cut = num_cond * (n // grid[0])
            out = torch.cat([_sdpa(q[:, :, :cut], k[:, :, :cut], v[:, :, :cut]), _sdpa(q[:, :, cut:], k, v)], dim=2)
        else:
            out = _sdpa(q, k, v)
        return self.proj(out.transpose(1, 2).reshape(b, n, c))


class CrossAttention(nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q_linear, self.kv_linear, self.proj = nn.Linear(dim, dim), nn.Linear(dim, dim * 2), nn.Linear(dim, dim)
        self.q_norm, self.k_norm = RMSNormFP32(self.head_dim), RMSNormFP32(self.head_dim)

    def forward(self, x, context, num_cond_tokens: int = 0):
        b, n, c = x.shape
        x_in = x[:, num_cond_tokens:]
        q = self.q_norm(self.q_linear(x_in).view(b, -1, self.heads, self.head_dim)).transpose(1, 2)
        k, v = self.kv_linear(context).view(b, -1, 2, self.heads, self.head_dim).unbind(2)
        k = self.k_norm(k)
        out = _sdpa(q, k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2).reshape(b, -1, c)
        out = self.proj(out)
        return torch.cat([out.new_zeros(b, num_cond_tokens, c), out], dim=1) if num_cond_tokens else out


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, multiple_of: int = 256):
        super().__init__()
        hidden = int(2 * hidden / 3)
        hidden = multiple_of * ((hidden + multiple_of - 1) // multiple_of)
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
        h = _modulate(self.mod_norm_attn, x.view(b, frames, -1, c), shift_msa, scale_msa).view(b, n, c)
        h = self.attn(h, grid, num_cond)
        x = (x + (gate_msa * h.view(b, frames, -1, c)).view(b, n, c)).to(dtype)
        x = x + self.cross_attn(self.pre_crs_attn_norm(x), context, num_cond * (n // frames))
        h = _modulate(self.mod_norm_ffn, x.view(b, frames, -1, c), shift_mlp, scale_mlp).view(b, n, c)
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
    out = _modulate(final.norm_final, hidden.view(b, grid[0], -1, c.hidden_size), shift, scale)
    out = _call32(final.linear, out.view(b, n, -1))
    out = out.reshape(b, *grid, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    out = out.reshape(b, -1, grid[0] * pt, grid[1] * ph, grid[2] * pw)
    return -out.float()


# -- recognition -----------------------------------------------------------------------------------------

LONGCAT_VIDEO_CONFIG = {"_class_name": "LongCatVideoTransformer3DModel", "in_channels": 16, "out_channels": 16,
                        "hidden_size": 4096, "depth": 48, "num_heads": 32, "caption_channels": 4096, "mlp_ratio": 4,
                        "adaln_tembed_dim": 512, "frequency_embedding_size": 256, "patch_size": [1, 2, 2],
                        "text_tokens_zero_pad": True}


def _swiglu_width(dim: int, ratio: float, multiple_of: int = 256) -> int:
    hidden = int(2 * int(dim * ratio) / 3)
    return multiple_of * ((hidden + multiple_of - 1) // multiple_of)


def infer_longcat_config(shapes: dict[str, tuple[int, ...]]) -> dict | None:
    """A bare LongCat-Video DiT's config from its shapes (the heads show in the per-head norms; the MLP ratio is
    4, the released one, where it gives the SwiGLU's width, else the smallest of 1..8 in quarter steps that does)."""
    try:
        hidden, cin = shapes["x_embedder.proj.weight"][:2]
        patch = list(shapes["x_embedder.proj.weight"][2:])
        depth = 1 + max(int(k.split(".")[1]) for k in shapes if k.startswith("blocks."))
        head_dim = shapes["blocks.0.attn.q_norm.weight"][0]
        width = shapes["blocks.0.ffn.w1.weight"][0]
        ratio = next(r / 4 for r in (16, *range(4, 33)) if _swiglu_width(hidden, r / 4) == width)
        tembed, freq = shapes["t_embedder.mlp.0.weight"]
        return dict(LONGCAT_VIDEO_CONFIG, in_channels=cin, out_channels=shapes["final_layer.linear.weight"][0] //
                    math.prod(patch), hidden_size=hidden, depth=depth, num_heads=hidden // head_dim,
                    caption_channels=shapes["y_embedder.y_proj.0.weight"][1], mlp_ratio=ratio,
                    adaln_tembed_dim=tembed, frequency_embedding_size=freq, patch_size=patch)
    except (KeyError, IndexError, ValueError, StopIteration):
        return None


LONGCAT_DIT = ComponentSpec(
    name="dit", library=__name__, class_name="LongCatVideoTransformer3DModel",
    known_configs={"LongCat-Video": LONGCAT_VIDEO_CONFIG},
    marker_keys=("x_embedder.proj.weight", "blocks.0.attn.qkv.weight", "final_layer.linear.weight"),
    infer_config=infer_longcat_config,
    description="LongCat-Video DiT (meituan-longcat/LongCat-Video dit/diffusion_pytorch_model*.safetensors)")


# -- units -------------------------------------------------------------------------------------------------

class LongCatVideoEmbedder(PipelineUnit):
    """`longcat_video` (the frames a continuation starts from) -> their VAE latents, kept clean in front."""

    feature = FEATURE
    inputs = ("longcat_video", "height", "width")
    outputs = ("longcat_latents",)
    models = ("vae",)

    def process(self, pipe, longcat_video, height, width):
        if longcat_video is None:
            return {}
        return {"longcat_latents": vae_encode(pipe, video_tensor(longcat_video, height, width)).to(pipe.torch_dtype)}


def is_longcat(context) -> bool:
    return dit_class(context) == "LongCatVideoTransformer3DModel"


LONGCAT = Feature(name=FEATURE, when=lambda c: is_longcat(c) or c.has("longcat_video"),
                  model_fn_inputs=("longcat_latents",), data_inputs=("longcat_video",),
                  description="LongCat-Video: its own text-to-video DiT over Wan's VAE and UMT5 (with longcat_video, "
                              "a continuation of that clip's first frames, given clean)")


class WanLongCatPipeline(WanVariantPipeline):
    """LongCat-Video on Wan2.1's VAE and UMT5: `model_fn_longcat` (its DiT's velocity negated). Its runs: its DiT,
    or a longcat_video column."""

    features = (LONGCAT,)
    own_inputs = ("longcat_video",)
    # the scripts name LongCat's own modules (attn.qkv, ffn.w1, ...); diffusers' Wan names (the family's default
    # targets) reach the same layers here
    lora_target_aliases = {"dit": {"to_q": "attn.qkv,cross_attn.q_linear", "to_k": "cross_attn.kv_linear",
                                   "to_v": "cross_attn.kv_linear", "to_out.0": "attn.proj,cross_attn.proj",
                                   "ffn.net.0.proj": "ffn.w1,ffn.w3", "ffn.net.2": "ffn.w2"}}

    def __init__(self, device="cpu", torch_dtype=torch.float32, scheduler=None):
        super().__init__(device, torch_dtype, scheduler)
        self.units = [WanShapeChecker(), WanNoiseInitializer(), WanInputVideoEmbedder(), WanPromptEmbedder(),
                      LongCatVideoEmbedder()]

    @classmethod
    def claims(cls, context) -> bool:
        return is_longcat(context) or context.has("longcat_video")

    @classmethod
    def check_run(cls, context, features):
        if context.config("dit") is not None and not is_longcat(context):
            raise UserError("longcat_video is LongCat-Video's input: its DiT (meituan-longcat/LongCat-Video dit/) "
                            "is not among the models")

    def model_fn(self, latents, timestep, prompt_embeds, longcat_latents=None, **settings):
        return model_fn_longcat(self.dit, latents, timestep, prompt_embeds, longcat_latents, **settings)


__all__ = ["WanLongCatPipeline", "FEATURE", "LONGCAT", "LONGCAT_DIT", "LONGCAT_VIDEO_CONFIG", "LORA_TARGET_MODULES",
           "LongCatVideoEmbedder", "LongCatVideoTransformer3DModel", "infer_longcat_config", "model_fn_longcat"]
