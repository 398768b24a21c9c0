"""Wan-Dancer's DiT, `WanDancerTransformer`, and its call (`model_fn_wan_dancer`): diffusers' Wan DiT with the
Dancer's modules added under the released file's own names (music injectors, reference-image embedding, music
encoder, the global path's patch embedding and head); both released files are this architecture, and the path
taken is a data value (`wantodance_fps`: 30 the plain one, any other the global one with its RoPE frames stretched
by 30 / fps, `global_frame_rope`)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import WanTransformer3DModel
from diffusers.configuration_utils import register_to_config
from torch import nn

from ....core.checkpointing import gradient_checkpoint_forward
from ....errors import UserError
from ..layers import (Head, ImageMLP, WanAttention, attend, diffusers_conditions, diffusers_inputs, diffusers_output,
                      diffusers_self_qkv, grid_table, modulate, modulated_ffn, rope_angles, rope_axis_dims, unpatchify)

DANCER_INJECT_LAYERS = [0, 4, 8, 12, 16, 20, 24, 27]
NATIVE_FPS = 30  # the rate of the plain path; any other runs the global path
MUSIC_FEATURES = 35
MUSIC_GRID = (149, 4800)  # the encoded music is first resized to this, as the released model was trained
GLOBAL_ROPE_FRAMES = int(22350 / 8 + 0.5)  # frame positions the stretched RoPE may reach


class _Injector(nn.Module):
    def __init__(self, dim: int, heads: int, count: int):
        super().__init__()
        self.injector = nn.ModuleList([WanAttention(dim, heads) for _ in range(count)])


def _rotate_half(x):
    pairs = x.unflatten(-1, (-1, 2))
    return torch.stack([-pairs[..., 1], pairs[..., 0]], dim=-1).flatten(-2)


class MusicEncoderLayer(nn.Module):
    """A pre-norm transformer layer whose queries and keys (not values) are rotated by position (RoPE over the
    whole width), GELU feed-forward; dropout as the released model was trained."""

    def __init__(self, dim: int, heads: int, ff: int, dropout: float):
        super().__init__()
        self.self_attn = nn.MultiheadAttention(dim, heads, dropout=dropout, batch_first=True)
        self.linear1, self.linear2 = nn.Linear(dim, ff), nn.Linear(ff, dim)
        self.norm1, self.norm2 = nn.LayerNorm(dim), nn.LayerNorm(dim)
        self.dropout, self.dropout1, self.dropout2 = nn.Dropout(dropout), nn.Dropout(dropout), nn.Dropout(dropout)
        self.register_buffer("rope_freqs", 1.0 / (10000 ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim)),
                             persistent=False)

    def rotate(self, x):
        positions = torch.arange(x.shape[-2], device=x.device, dtype=self.rope_freqs.dtype)
        freqs = torch.repeat_interleave(positions[:, None] * self.rope_freqs.to(x.device)[None], 2, dim=-1)
        freqs = freqs.to(x.dtype)  # the angles in the input's dtype, as the released model computes them
        # LLaMA's rotate-half form over the whole width (not Wan's 3-D RoPE), in this order: the gradients then sum
        # as the reference's
        return x * freqs.cos() + _rotate_half(x) * freqs.sin()

    def forward(self, x):
        h = self.norm1(x)
        qk = self.rotate(h)
        x = x + self.dropout1(self.self_attn(qk, qk, h, need_weights=False)[0])
        return x + self.dropout2(self.linear2(self.dropout(F.gelu(self.linear1(self.norm2(x))))))


class WanDancerTransformer(WanTransformer3DModel):
    """diffusers' Wan DiT plus Wan-Dancer's modules (in the released file's names)."""

    @register_to_config
    def __init__(self, patch_size=(1, 2, 2), num_attention_heads: int = 40, attention_head_dim: int = 128,
                 in_channels: int = 36, out_channels: int = 16, text_dim: int = 4096, freq_dim: int = 256,
                 ffn_dim: int = 13824, num_layers: int = 40, cross_attn_norm: bool = True,
                 qk_norm: str | None = "rms_norm_across_heads", eps: float = 1e-6, image_dim: int | None = 1280,
                 added_kv_proj_dim: int | None = 5120, rope_max_seq_len: int = 1024, pos_embed_seq_len=None,
                 music_inject_layers=tuple(DANCER_INJECT_LAYERS), enable_music_inject: bool = True,
                 enable_refimage: bool = True, enable_global: bool = True, enable_dynamicfps: bool = True,
                 enable_unimodel: bool = True, has_ref_conv: bool = True, music_latent_dim: int = 256,
                 music_heads: int = 4, music_ff: int = 1024, music_layers: int = 2, music_dropout: float = 0.1):
        super().__init__(patch_size=patch_size, num_attention_heads=num_attention_heads,
                         attention_head_dim=attention_head_dim, in_channels=in_channels, out_channels=out_channels,
                         text_dim=text_dim, freq_dim=freq_dim, ffn_dim=ffn_dim, num_layers=num_layers,
                         cross_attn_norm=cross_attn_norm, qk_norm=qk_norm, eps=eps, image_dim=image_dim,
                         added_kv_proj_dim=added_kv_proj_dim, rope_max_seq_len=rope_max_seq_len,
                         pos_embed_seq_len=pos_embed_seq_len)
        dim = num_attention_heads * attention_head_dim
        inject = [i for i in music_inject_layers if 0 <= i < num_layers]
        self.injected = {block: n for n, block in enumerate(inject)}
        if enable_music_inject:
            self.music_injector = _Injector(dim, num_attention_heads, len(inject))
        if enable_refimage:
            self.img_emb_refimage = ImageMLP(image_dim or 1280, dim)
        if enable_global or enable_dynamicfps or enable_unimodel:
            self.music_projection = nn.Linear(MUSIC_FEATURES, music_latent_dim)
            self.music_encoder = nn.Sequential(*[MusicEncoderLayer(music_latent_dim, music_heads, music_ff,
                                                                   music_dropout) for _ in range(music_layers)])
        if enable_unimodel:
            self.patch_embedding_global = nn.Conv3d(in_channels, dim, kernel_size=tuple(patch_size),
                                                    stride=tuple(patch_size))
            self.head_global = Head(dim, out_channels * math.prod(patch_size), eps)
        if has_ref_conv:
            self.ref_conv = nn.Conv2d(16, dim, kernel_size=(2, 2), stride=(2, 2))


def is_global(fps) -> bool:
    return fps is not None and int(float(fps) + 0.5) != NATIVE_FPS


def global_frame_rope(dim: int, frames: int, fps: float):
    """The global path's frame-axis RoPE rows ((frames, dim / 2) real and imaginary parts): the native 30 fps rows
    of the stretched time span, linearly interpolated (as complex numbers) at 30 / fps steps, ends kept."""
    step = 30.0 / (float(fps) + 1e-6)
    total = int(step * frames + 0.5)
    if total > GLOBAL_ROPE_FRAMES:
        raise UserError(f"wantodance_fps {fps}: {frames} latent frames span {total} positions, more than the model's "
                        f"{GLOBAL_ROPE_FRAMES}")
    angles = rope_angles(dim, torch.arange(total))
    cos, sin = angles.cos(), angles.sin()
    rows_c, rows_s = cos.new_zeros(frames, cos.shape[1]), sin.new_zeros(frames, sin.shape[1])
    rows_c[0], rows_s[0] = cos[0], sin[0]
    rows_c[-1], rows_s[-1] = cos[total - 1], sin[total - 1]  # (one frame: the last row, written second)
    for i in range(1, frames - 1):
        pos = i * step
        low = int(pos)
        high = min(low + 1, total - 1)
        w = pos - low
        rows_c[i] = cos[low] * (1 - w) + cos[high] * w
        rows_s[i] = sin[low] * (1 - w) + sin[high] * w
    return rows_c, rows_s


def dancer_rope(head_dim: int, grid, fps=None):
    """(cos, sin) tables, each (1, tokens, 1, head_dim / 2); the frame axis stretched on the global path."""
    f, h, w = grid
    t_dim, h_dim, w_dim = rope_axis_dims(head_dim)
    if is_global(fps):
        ct, st = global_frame_rope(t_dim, f, fps)
    else:
        at = rope_angles(t_dim, torch.arange(f))
        ct, st = at.cos(), at.sin()
    ah, aw = rope_angles(h_dim, torch.arange(h)), rope_angles(w_dim, torch.arange(w))
    return grid_table(ct, ah.cos(), aw.cos())[None, :, None], grid_table(st, ah.sin(), aw.sin())[None, :, None]


def dancer_block(block, x, context, temb, rope, image_tokens: int):
    """diffusers' Wan block, with the cross-attention's image tokens the first `image_tokens` of the context (the
    reference image's; the keyframe's CLIP tokens and the text are attended as text, as the released model)."""
    shift, scale, gate, c_shift, c_scale, c_gate = (block.scale_shift_table + temb.float()).chunk(6, dim=1)
    attn = block.attn1
    q, k, v = diffusers_self_qkv(attn, modulate(block.norm1, x, shift, scale), rope)
    x = (x.float() + attn.to_out[0](attend(q, k, v).type_as(x)) * gate).type_as(x)
    cross = block.attn2
    split = lambda t: t.unflatten(2, (cross.heads, -1))  # noqa: E731
    h = block.norm2(x.float()).type_as(x)
    img, text = context[:, :image_tokens], context[:, image_tokens:]
    q = split(cross.norm_q(cross.to_q(h)))
    out = attend(q, split(cross.norm_k(cross.to_k(text))), split(cross.to_v(text)))
    if image_tokens and cross.add_k_proj is not None:
        out = out + attend(q, split(cross.norm_added_k(cross.add_k_proj(img))), split(cross.add_v_proj(img)))
    x = x + cross.to_out[0](out.type_as(x))
    return modulated_ffn(block.norm3, block.ffn, x, c_shift, c_scale, c_gate)


def encode_music(dit: WanDancerTransformer, music_feature: torch.Tensor, frames: int, dim: int) -> torch.Tensor:
    """(T, 35) music features -> (B, frames * 8, dim): projected and encoded, resized to 149 x 4800 and then to
    eight rows per latent frame of the model's width (bilinear, as the released model)."""
    feats = music_feature if music_feature.dim() == 3 else music_feature[None]
    dtype = dit.music_projection.weight.dtype
    enc = dit.music_encoder(dit.music_projection(feats.to(dtype)))
    enc = F.interpolate(enc[:, None], size=MUSIC_GRID, mode="bilinear")
    return F.interpolate(enc, size=(frames * 8, dim), mode="bilinear")[:, 0]


def inject_music(dit: WanDancerTransformer, block: int, x: torch.Tensor, music: torch.Tensor) -> torch.Tensor:
    """After an injected block: each eighth of a latent frame's tokens attends to its row of the music."""
    if block not in dit.injected:
        return x
    b, n, c = x.shape
    rows = music.shape[1]
    if n % rows:
        raise UserError(f"Wan-Dancer's music rows ({rows}, 8 per latent frame) must divide the tokens ({n}): the "
                        "latent frame's tokens (height/16 x width/16) must be a multiple of 8")
    tokens = F.layer_norm(x.reshape(b * rows, n // rows, c), (c,), eps=1e-6)
    out = dit.music_injector.injector[dit.injected[block]](tokens, music.reshape(b * rows, 1, c).to(x.dtype))
    return x + out.reshape(b, n, c)


def model_fn_wan_dancer(dit: WanDancerTransformer, latents: torch.Tensor, timestep: torch.Tensor,
                        prompt_embeds: torch.Tensor, image_embeds: torch.Tensor | None = None,
                        condition: torch.Tensor | None = None,
                        wantodance_refimage_feature: torch.Tensor | None = None,
                        music_feature: torch.Tensor | None = None, wantodance_fps: float | None = None,
                        skip_9th_layer: bool = False, use_gradient_checkpointing: bool = False,
                        use_gradient_checkpointing_offload: bool = False, **_: Any) -> torch.Tensor:
    """One Wan-Dancer call: the I2V condition (keyframes) on channels, the reference image's and the first
    keyframe's CLIP tokens before the text, music injected after the listed blocks; `wantodance_fps` other than 30
    takes the global path. `skip_9th_layer` (the global model's negative pass) leaves block 9 out."""
    c = dit.config
    fps = NATIVE_FPS if wantodance_fps is None else float(wantodance_fps)
    if isinstance(wantodance_fps, torch.Tensor):
        fps = float(wantodance_fps.reshape(-1)[0])
    x, dtype, grid = diffusers_inputs(dit, latents, condition)
    embed = dit.patch_embedding_global if c.enable_global and is_global(fps) else dit.patch_embedding
    hidden = embed(x).flatten(2).transpose(1, 2)
    temb, tproj, context, image_tokens = diffusers_conditions(dit, timestep, prompt_embeds, image_embeds,
                                                              latents.shape[0], x.device, dtype)
    if c.enable_global and wantodance_refimage_feature is not None:
        ref = dit.img_emb_refimage(wantodance_refimage_feature.to(dtype))
        context = torch.cat([ref, context], dim=1)
        image_tokens = ref.shape[1]
    stretched = (c.enable_dynamicfps or c.enable_unimodel) and is_global(fps)
    rope = tuple(r.to(x.device) for r in dancer_rope(c.attention_head_dim, grid, fps if stretched else None))
    music = None
    if music_feature is not None and (c.enable_global or c.enable_dynamicfps or c.enable_unimodel):
        music = encode_music(dit, music_feature.to(x.device), latents.shape[2], context.shape[2])
    for i, block in enumerate(dit.blocks):
        if skip_9th_layer and i == 9:
            continue
        hidden = gradient_checkpoint_forward(dancer_block, use_gradient_checkpointing,
                                             use_gradient_checkpointing_offload, block, hidden, context, tproj, rope,
                                             image_tokens)
        if music is not None and c.enable_music_inject:
            hidden = inject_music(dit, i, hidden, music)
    if c.enable_unimodel and is_global(fps):
        return unpatchify(dit.head_global(hidden, temb), grid, c.patch_size)
    return diffusers_output(dit, hidden, temb, grid)


__all__ = ["DANCER_INJECT_LAYERS", "NATIVE_FPS", "MusicEncoderLayer", "WanDancerTransformer", "dancer_block",
           "dancer_rope", "encode_music", "global_frame_rope", "inject_music", "is_global", "model_fn_wan_dancer"]
