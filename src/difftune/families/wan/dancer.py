"""Wan-Dancer-14B (Wan-AI/Wan-Dancer-14B: `global_model.safetensors`, `local_model.safetensors`): Wan2.1 I2V-14B
with music injected after some blocks, a reference-image embedding, and a second patch embedding / head for
keyframes at another frame rate.

`WanDancerTransformer` is diffusers' `WanTransformer3DModel` with the Dancer's modules added under the released
file's own names (`music_injector.injector.N.q`, `img_emb_refimage.proj.1`, `music_projection`,
`music_encoder.N.self_attn.in_proj_weight`, `patch_embedding_global`, `head_global.head`, `ref_conv`); the file's
Wan base is in Wan-AI's names and goes through diffusers' converter (`dancer_from_original`), so a full checkpoint
written back in original names (`dancer_to_original`) is the layout the reference loads.

Both files are one architecture; which path runs is a data value, `wantodance_fps`: at 30 fps (the local model's
data) the plain patch embedding, RoPE and head; at any other rate (the global model's 7.5 fps keyframes) the
`_global` ones and frame positions stretched by 30 / fps (`global_frame_rope`). Training inputs, as the scripts
give them (`--extra_inputs wantodance_music_path,wantodance_reference_image,wantodance_fps,wantodance_keyframes,
wantodance_keyframes_mask[,framewise_decoding]`):
  * `wantodance_music_path`: the music's 35 librosa features (onset strength, 20 MFCCs, 12 CENS chroma, onset and
    beat one-hots) at 30 features a second (`music_features`), encoded by the DiT's music encoder;
  * `wantodance_reference_image`: its CLIP embedding, the image tokens of every cross-attention;
  * `wantodance_keyframes` + `wantodance_keyframes_mask`: the I2V condition (keyframes VAE-encoded, a mask of the
    frames that are keyframes) and the first keyframe's CLIP embedding (which stands in the text tokens' place);
  * `framewise_decoding` (the global model): every frame VAE-encoded alone, one latent frame per video frame.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from diffusers import WanTransformer3DModel
from diffusers.configuration_utils import register_to_config
from torch import nn

from ...core.batch import LIST, SAME
from ...core.checkpointing import gradient_checkpoint_forward
from ...core.features import Feature
from ...core.units import PipelineUnit
from ...errors import UserError
from ...models.detect import ComponentSpec
from .components import WAN_DIT_CONFIGS
from .s2v import RMSNorm
from .units import (WanImageEmbedderCLIP, WanInputVideoEmbedder, WanNoiseInitializer, WanPromptEmbedder,
                    WanShapeChecker, frames_of, vae_decode, vae_encode, vae_scales, video_tensor)
from .variant import WanVariantPipeline, as_list, dit_class

FEATURE = "dancer"
FRAMEWISE = "dancer_framewise"
DANCER_INJECT_LAYERS = [0, 4, 8, 12, 16, 20, 24, 27]
NATIVE_FPS = 30  # the rate of the plain path; any other runs the global path
MUSIC_FEATURES = 35
MUSIC_GRID = (149, 4800)  # the encoded music is first resized to this, as the released model was trained
GLOBAL_ROPE_FRAMES = int(22350 / 8 + 0.5)  # frame positions the stretched RoPE may reach
_EXTRA_PREFIXES = ("music_injector.", "img_emb_refimage.", "music_projection.", "music_encoder.",
                   "patch_embedding_global.", "head_global.", "ref_conv.", "img_emb_refface.")


class _WanAttention(nn.Module):
    """Wan's original attention (q, k, v, o, norm_q, norm_k): the music injectors."""

    def __init__(self, dim: int, heads: int, eps: float = 1e-6):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q, self.norm_k = RMSNorm(dim, eps), RMSNorm(dim, eps)

    def forward(self, x, context):
        split = lambda t: t.unflatten(2, (self.heads, -1)).transpose(1, 2)  # noqa: E731
        q, k, v = split(self.norm_q(self.q(x))), split(self.norm_k(self.k(context))), split(self.v(context))
        return self.o(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class _Injector(nn.Module):
    def __init__(self, dim: int, heads: int, count: int):
        super().__init__()
        self.injector = nn.ModuleList([_WanAttention(dim, heads) for _ in range(count)])


class _MLP(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.proj = nn.Sequential(nn.LayerNorm(cin), nn.Linear(cin, cin), nn.GELU(), nn.Linear(cin, cout),
                                  nn.LayerNorm(cout))

    def forward(self, x):
        return self.proj(x)


class _Head(nn.Module):
    def __init__(self, dim: int, out: int, eps: float):
        super().__init__()
        self.norm = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.head = nn.Linear(dim, out)
        self.modulation = nn.Parameter(torch.randn(1, 2, dim) / dim ** 0.5)

    def forward(self, x, t):
        shift, scale = (self.modulation + t[:, None]).chunk(2, dim=1)
        return self.head(self.norm(x) * (1 + scale) + shift)


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
            self.img_emb_refimage = _MLP(image_dim or 1280, dim)
        if enable_global or enable_dynamicfps or enable_unimodel:
            self.music_projection = nn.Linear(MUSIC_FEATURES, music_latent_dim)
            self.music_encoder = nn.Sequential(*[MusicEncoderLayer(music_latent_dim, music_heads, music_ff,
                                                                   music_dropout) for _ in range(music_layers)])
        if enable_unimodel:
            self.patch_embedding_global = nn.Conv3d(in_channels, dim, kernel_size=tuple(patch_size),
                                                    stride=tuple(patch_size))
            self.head_global = _Head(dim, out_channels * math.prod(patch_size), eps)
        if has_ref_conv:
            self.ref_conv = nn.Conv2d(16, dim, kernel_size=(2, 2), stride=(2, 2))


def is_global(fps) -> bool:
    return fps is not None and int(float(fps) + 0.5) != NATIVE_FPS


def _axis_cos_sin(dim: int, positions: torch.Tensor, theta: float = 10000.0):
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[: dim // 2] / dim))
    angles = positions.to(torch.float64)[:, None] * inv[None]
    return angles.cos(), angles.sin()


def global_frame_rope(dim: int, frames: int, fps: float):
    """The global path's frame-axis RoPE rows ((frames, dim / 2) real and imaginary parts): the native 30 fps rows
    of the stretched time span, linearly interpolated (as complex numbers) at 30 / fps steps, ends kept."""
    step = 30.0 / (float(fps) + 1e-6)
    total = int(step * frames + 0.5)
    if total > GLOBAL_ROPE_FRAMES:
        raise UserError(f"wantodance_fps {fps}: {frames} latent frames span {total} positions, more than the model's "
                        f"{GLOBAL_ROPE_FRAMES}")
    cos, sin = _axis_cos_sin(dim, torch.arange(total))
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
    """(1, tokens, 1, head_dim) cos / sin tables in diffusers' interleaved layout; the frame axis stretched on the
    global path."""
    f, h, w = grid
    h_dim = 2 * (head_dim // 6)
    t_dim = head_dim - 2 * h_dim
    if is_global(fps):
        ct, st = global_frame_rope(t_dim, f, fps)
    else:
        ct, st = _axis_cos_sin(t_dim, torch.arange(f))
    ch, sh = _axis_cos_sin(h_dim, torch.arange(h))
    cw, sw = _axis_cos_sin(h_dim, torch.arange(w))

    def table(a, b, c):
        a, b, c = (t.repeat_interleave(2, dim=1) for t in (a, b, c))
        full = torch.cat([a[:, None, None].expand(f, h, w, -1), b[None, :, None].expand(f, h, w, -1),
                          c[None, None, :].expand(f, h, w, -1)], dim=-1)
        return full.reshape(1, f * h * w, 1, head_dim)

    return table(ct, ch, cw), table(st, sh, sw)


def _rotate(x, cos, sin):
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    return torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2).type_as(x)


def _attend(q, k, v):  # (B, S, H, D)
    return F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)).transpose(1, 2) \
        .flatten(2)


def dancer_block(block, x, context, temb, rope, image_tokens: int):
    """diffusers' Wan block, with the cross-attention's image tokens the first `image_tokens` of the context (the
    reference image's; the keyframe's CLIP tokens and the text are attended as text, as the released model)."""
    shift, scale, gate, c_shift, c_scale, c_gate = (block.scale_shift_table + temb.float()).chunk(6, dim=1)
    attn = block.attn1
    split = lambda t, a: t.unflatten(2, (a.heads, -1))  # noqa: E731
    h = (block.norm1(x.float()) * (1 + scale) + shift).type_as(x)
    q = _rotate(split(attn.norm_q(attn.to_q(h)), attn), *rope)
    k = _rotate(split(attn.norm_k(attn.to_k(h)), attn), *rope)
    out = attn.to_out[0](_attend(q, k, split(attn.to_v(h), attn)).type_as(x))
    x = (x.float() + out * gate).type_as(x)
    cross = block.attn2
    h = block.norm2(x.float()).type_as(x)
    img, text = context[:, :image_tokens], context[:, image_tokens:]
    q = split(cross.norm_q(cross.to_q(h)), cross)
    out = _attend(q, split(cross.norm_k(cross.to_k(text)), cross), split(cross.to_v(text), cross))
    if image_tokens and cross.add_k_proj is not None:
        out = out + _attend(q, split(cross.norm_added_k(cross.add_k_proj(img)), cross),
                            split(cross.add_v_proj(img), cross))
    x = x + cross.to_out[0](out.type_as(x))
    h = (block.norm3(x.float()) * (1 + c_scale) + c_shift).type_as(x)
    return (x.float() + block.ffn(h).float() * c_gate).type_as(x)


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
    dtype = dit.dtype if dit.dtype.is_floating_point else latents.dtype
    b = latents.shape[0]
    x = latents if condition is None else torch.cat([latents, condition.to(latents.dtype)], dim=1)
    x = x.to(dtype)
    pt, ph, pw = c.patch_size
    grid = (x.shape[2] // pt, x.shape[3] // ph, x.shape[4] // pw)
    embed = dit.patch_embedding_global if c.enable_global and is_global(fps) else dit.patch_embedding
    hidden = embed(x).flatten(2).transpose(1, 2)
    t = timestep.to(x.device).reshape(-1).expand(b)
    temb, tproj, context, image = dit.condition_embedder(
        t, prompt_embeds.to(dtype), None if image_embeds is None else image_embeds.to(dtype))
    tproj = tproj.unflatten(1, (6, -1))
    if image is not None:
        context = torch.cat([image, context], dim=1)
    image_tokens = 0 if image is None else image.shape[1]
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
        out = dit.head_global(hidden, temb)
    else:
        shift, scale = (dit.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
        out = dit.proj_out((dit.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden))
    out = out.reshape(b, *grid, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return out.flatten(6, 7).flatten(4, 5).flatten(2, 3)


# -- the released layout ----------------------------------------------------------------------------------

def dancer_from_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The released file (Wan-AI's names) -> `WanDancerTransformer`'s: the Wan base through diffusers' converter,
    the Dancer's modules as they are (their names are the model's)."""
    from diffusers.loaders.single_file_utils import convert_wan_transformer_to_diffusers

    extras = {k: v for k, v in state.items() if k.startswith(_EXTRA_PREFIXES)}
    base = {k: v for k, v in state.items() if not k.startswith(_EXTRA_PREFIXES)}
    return {**convert_wan_transformer_to_diffusers(base), **extras}


def dancer_to_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`WanDancerTransformer`'s state dict -> the released file's names (--full_format original)."""
    from .dit_keys import dit_to_original

    extras = {k: v for k, v in state.items() if k.startswith(_EXTRA_PREFIXES)}
    base = {k: v for k, v in state.items() if not k.startswith(_EXTRA_PREFIXES)}
    return {**dit_to_original(base), **extras}


DANCER_14B_CONFIG = dict({k: v for k, v in WAN_DIT_CONFIGS["Wan2.1-I2V-14B"].items()},
                         _class_name="WanDancerTransformer", music_inject_layers=DANCER_INJECT_LAYERS,
                         enable_music_inject=True, enable_refimage=True, enable_global=True, enable_dynamicfps=True,
                         enable_unimodel=True, has_ref_conv=True, music_latent_dim=256, music_heads=4, music_ff=1024,
                         music_layers=2, music_dropout=0.1)


def infer_dancer_config(shapes: dict[str, tuple[int, ...]]) -> dict | None:
    """A bare Dancer DiT's config from its (converted) shapes; Wan's 128-channel heads; the injected blocks as the
    released list for 40 blocks and 8 injectors, else spread evenly."""
    try:
        dim, cin = shapes["patch_embedding.weight"][:2]
        layers = 1 + max(int(k.split(".")[1]) for k in shapes if k.startswith("blocks."))
        injectors = 1 + max((int(k.split(".")[2]) for k in shapes if k.startswith("music_injector.injector.")),
                            default=-1)
        image = shapes.get("condition_embedder.image_embedder.norm1.weight", (None,))[0]
        heads = max(1, dim // 128)
        config = dict(DANCER_14B_CONFIG, num_attention_heads=heads, attention_head_dim=dim // heads,
                      in_channels=cin, out_channels=shapes["proj_out.weight"][0] // 4, num_layers=layers,
                      ffn_dim=shapes["blocks.0.ffn.net.0.proj.weight"][0],
                      text_dim=shapes["condition_embedder.text_embedder.linear_1.weight"][1],
                      freq_dim=shapes["condition_embedder.time_embedder.linear_1.weight"][1], image_dim=image,
                      added_kv_proj_dim=dim if image else None,
                      enable_music_inject=injectors > 0, enable_refimage="img_emb_refimage.proj.1.weight" in shapes,
                      enable_unimodel="patch_embedding_global.weight" in shapes,
                      has_ref_conv="ref_conv.weight" in shapes)
        if "music_projection.weight" in shapes:
            config.update(music_latent_dim=shapes["music_projection.weight"][0],
                          music_ff=shapes["music_encoder.0.linear1.weight"][0],
                          music_layers=1 + max(int(k.split(".")[1]) for k in shapes if k.startswith("music_encoder.")))
        config["music_inject_layers"] = DANCER_INJECT_LAYERS if (layers, injectors) == (40, 8) else \
            [round(i * (layers - 1) / max(injectors - 1, 1)) for i in range(injectors)]
        return config
    except (KeyError, IndexError, ValueError):
        return None


DANCER_DIT = ComponentSpec(
    name="dit", library=__name__, class_name="WanDancerTransformer",
    known_configs={"Wan-Dancer-14B": DANCER_14B_CONFIG},
    marker_keys=("music_projection.weight", "blocks.0.self_attn.q.weight", "head.modulation"),
    convert_state_dict=dancer_from_original, infer_config=infer_dancer_config,
    description="Wan-Dancer-14B DiT (Wan-AI/Wan-Dancer-14B global_model / local_model .safetensors)")


# -- the music features -----------------------------------------------------------------------------------

LIBROSA_MISSING = ("wantodance_music_path: Wan-Dancer's music features are librosa's (as the reference's), and "
                   "librosa is not installed: pip install 'difftune[audio]'")


def has_librosa() -> bool:
    import importlib.util

    return importlib.util.find_spec("librosa") is not None

def music_features(path: str, fps: int = NATIVE_FPS):
    """The reference's music features of an audio file, (T, 35) float32 at `fps` a second (librosa: onset
    strength, 20 MFCCs, 12 CENS chroma, onset-peak and beat one-hots), computed as the reference does (the
    audio loaded at fps x 512 Hz, the features at librosa's 22050 Hz default settings, the starting tempo from
    the file at 22050 Hz)."""
    try:
        import librosa
        import numpy as np
    except ImportError:
        raise UserError(LIBROSA_MISSING) from None
    from ...media.audio import AudioError, check_audio

    try:
        check_audio(path)
    except AudioError as err:
        raise UserError(str(err)) from None
    hop = 512
    data, _ = librosa.load(path, sr=fps * hop)
    sr = 22050
    envelope = librosa.onset.onset_strength(y=data, sr=sr)
    mfcc = librosa.feature.mfcc(y=data, sr=sr, n_mfcc=20).T
    chroma = librosa.feature.chroma_cens(y=data, sr=sr, hop_length=hop, n_chroma=12).T
    peaks = librosa.onset.onset_detect(onset_envelope=envelope.flatten(), sr=sr, hop_length=hop)
    peak = np.zeros_like(envelope, dtype=np.float32)
    peak[peaks] = 1.0
    # librosa.beat.tempo (the reference's call) moved to librosa.feature.rhythm.tempo in 0.10 and is gone in 1.0
    tempo_of = getattr(getattr(librosa.feature, "rhythm", None), "tempo", None) or librosa.beat.tempo
    tempo = tempo_of(y=librosa.load(path)[0])[0]
    _, beats = librosa.beat.beat_track(onset_envelope=envelope, sr=sr, hop_length=hop, start_bpm=tempo, tightness=100)
    beat = np.zeros_like(envelope, dtype=np.float32)
    beat[beats] = 1.0
    feats = np.concatenate([envelope[:, None], mfcc, chroma, peak[:, None], beat[:, None]], axis=-1)
    return torch.from_numpy(feats.astype(np.float32))


# -- units -------------------------------------------------------------------------------------------------

class WanDancerMusic(PipelineUnit):
    """`wantodance_music_path` -> the music's features (`music_features`); no model, so always cached."""

    feature = FEATURE
    inputs = ("wantodance_music_path",)
    outputs = ("music_feature",)

    def process(self, pipe, wantodance_music_path):
        if wantodance_music_path is None:
            return {}
        paths = wantodance_music_path if isinstance(wantodance_music_path, (list, tuple)) else [wantodance_music_path]
        feats = [music_features(str(p)) for p in paths]
        if len({f.shape for f in feats}) > 1:
            raise UserError("Wan-Dancer: the music of one batch must be equally long")
        return {"music_feature": torch.stack(feats).to(pipe.torch_dtype)}


class WanDancerReferenceImage(PipelineUnit):
    """`wantodance_reference_image` -> its CLIP embedding (the cross-attention's image tokens)."""

    feature = FEATURE
    inputs = ("wantodance_reference_image", "height", "width")
    outputs = ("wantodance_refimage_feature",)
    models = ("image_encoder",)

    def process(self, pipe, wantodance_reference_image, height, width):
        if wantodance_reference_image is None:
            return {}
        image = wantodance_reference_image
        image = frames_of(image)[0] if not hasattr(image, "size") or isinstance(image, list) else image
        out = WanImageEmbedderCLIP().process(pipe, image, None, height, width, 1)
        return {"wantodance_refimage_feature": out["image_embeds"]} if "image_embeds" in out else {}


def keyframe_mask(mask, num_frames: int, height: int, width: int, spatial: int = 8, temporal: int = 4):
    """The 4-channel I2V mask of the keyframes: 1 on the frames `mask` marks, the first frame standing for
    `temporal` frames as the VAE's first latent frame does: (1, 4, latent frames, h, w)."""
    mask = torch.as_tensor(mask, dtype=torch.float32).flatten()
    if mask.numel() != num_frames:
        raise UserError(f"wantodance_keyframes_mask has {mask.numel()} entries, the clip {num_frames} frames")
    known = (mask == 1).float()
    known = torch.cat([known[:1].repeat(temporal), known[1:]])
    h, w = height // spatial, width // spatial
    return known.view(-1, temporal, 1, 1).expand(-1, temporal, h, w).transpose(0, 1)[None]


class WanDancerKeyframes(PipelineUnit):
    """`wantodance_keyframes` (a clip: keyframes, black elsewhere) and `wantodance_keyframes_mask` -> the I2V
    condition (the keyframe mask + the keyframes' VAE latents) and the first keyframe's CLIP embedding; stands in
    for the input-image condition."""

    feature = FEATURE
    replaces = ("WanImageEmbedderCLIP", "WanImageEmbedderVAE")
    inputs = ("wantodance_keyframes", "wantodance_keyframes_mask", "num_frames", "height", "width")
    outputs = ("image_embeds", "condition")
    models = ("image_encoder", "vae")

    def process(self, pipe, wantodance_keyframes, wantodance_keyframes_mask, num_frames, height, width):
        if wantodance_keyframes is None:
            return {}
        if wantodance_keyframes_mask is None:
            raise UserError("wantodance_keyframes needs wantodance_keyframes_mask (which frames are keyframes)")
        frames = frames_of(wantodance_keyframes)
        _, spatial, temporal = vae_scales(pipe.vae)
        z = vae_encode(pipe, video_tensor(frames, height, width))
        mask = keyframe_mask(wantodance_keyframes_mask, num_frames, height, width, spatial, temporal)
        if mask.shape[2] != z.shape[2]:
            raise UserError(f"wantodance_keyframes: {len(frames)} frames give {z.shape[2]} latent frames, the mask "
                            f"of {num_frames} frames {mask.shape[2]}")
        clip = WanImageEmbedderCLIP().process(pipe, frames[0], None, height, width, 1)
        out = {"condition": torch.cat([mask.to(z.device, z.dtype), z], dim=1).to(pipe.torch_dtype)}
        if "image_embeds" in clip:
            out["image_embeds"] = clip["image_embeds"]
        return out


class WanDancerFramewiseVideo(PipelineUnit):
    """The global model's clips (a true `framewise_decoding`): every frame VAE-encoded alone, one latent frame
    each; other rows' clips as usual."""

    feature = FRAMEWISE
    replaces = ("WanInputVideoEmbedder",)
    inputs = ("input_video", "noise", "height", "width", "framewise_decoding")
    outputs = ("latents", "input_latents")
    models = ("vae",)

    def process(self, pipe, input_video, noise, height, width, framewise_decoding):
        if input_video is None:
            return {"latents": noise}
        frames = frames_of(input_video)
        if not framewise_decoding:
            return WanInputVideoEmbedder().process(pipe, input_video, noise, height, width)
        latents = torch.cat([vae_encode(pipe, video_tensor([f], height, width)) for f in frames], dim=2)
        if pipe.scheduler.training:
            return {"latents": noise, "input_latents": latents}
        raise UserError("video-to-video sampling (input_video) is not supported yet")


class WanDancerFps(PipelineUnit):
    """`wantodance_fps`: the clip's frame rate (30 when not given, the plain path), a positive number."""

    feature = FEATURE
    inputs = ("wantodance_fps",)
    outputs = ("wantodance_fps",)
    batching = {"wantodance_fps": SAME}  # one path per batch: the global or the plain one

    def process(self, pipe, wantodance_fps):
        values = wantodance_fps if isinstance(wantodance_fps, (list, tuple)) else [wantodance_fps]
        rates = {NATIVE_FPS if v is None else v for v in values}
        try:
            rates = {float(v) for v in rates}
        except (TypeError, ValueError):
            raise UserError(f"wantodance_fps must be a number (frames a second), got {sorted(map(str, rates))}") \
                from None
        if len(rates) != 1 or min(rates) <= 0:
            raise UserError(f"wantodance_fps must be one positive number per batch, got {sorted(rates)}")
        return {"wantodance_fps": rates.pop()}


def is_dancer(context) -> bool:
    return dit_class(context) == "WanDancerTransformer"


DANCER = Feature(name=FEATURE, when=lambda c: is_dancer(c) or c.has("wantodance_music_path", "wantodance_keyframes",
                                                                    "wantodance_reference_image"),
                 model_fn_inputs=("wantodance_refimage_feature", "music_feature", "wantodance_fps", "image_embeds",
                                  "condition"),
                 data_inputs=("wantodance_music_path", "wantodance_reference_image", "wantodance_fps",
                              "wantodance_keyframes", "wantodance_keyframes_mask"),
                 description="Wan-Dancer: music, reference image and keyframes")
# the global model's data: a `framewise_decoding` column (and --framewise_decoding for the frame count rule)
DANCER_FRAMEWISE = Feature(name=FRAMEWISE, columns=("framewise_decoding",), requires=(FEATURE,),
                           data_inputs=("framewise_decoding",),
                           description="Wan-Dancer global: one latent frame per video frame")
DANCER_UNITS = (WanDancerFps, WanDancerMusic, WanDancerReferenceImage, WanDancerKeyframes, WanDancerFramewiseVideo)


def framewise_num_frames(clip_frames: int) -> int:
    """The frame count the global model's latents stand for: 4 (n - 1) + 1 for n framewise-encoded frames (the
    reference's training script sets num_frames so)."""
    return 4 * (int(clip_frames) - 1) + 1


# the reference's LoRA names on the Dancer DiT also reach the music injectors' q, k, v, o (Wan's own names there)
DANCER_LORA_ALIASES = {"q": "to_q,q", "k": "to_k,k", "v": "to_v,v", "o": "to_out.0,o", "ffn.0": "ffn.net.0.proj",
                       "ffn.2": "ffn.net.2"}


class WanDancerPipeline(WanVariantPipeline):
    """Wan-Dancer-14B (global and local models: one architecture): music, a reference image and keyframes
    (`model_fn_wan_dancer`); with a true `framewise_decoding` (the global model's keyframe clips) one latent frame per
    video frame, encoded and decoded frame by frame. Guidance's negative pass leaves block 9 out, as the
    reference's. Its runs: its DiT, or the wantodance_* columns."""

    features = (DANCER, DANCER_FRAMEWISE)
    own_inputs = ("wantodance_music_path", "wantodance_reference_image", "wantodance_fps", "wantodance_keyframes",
                      "wantodance_keyframes_mask", "framewise_decoding")
    lora_target_aliases = {"dit": DANCER_LORA_ALIASES}
    input_batching = {**WanVariantPipeline.input_batching, "wantodance_fps": SAME, "framewise_decoding": SAME,
                      "wantodance_keyframes_mask": LIST}

    def __init__(self, device="cpu", torch_dtype=torch.float32, scheduler=None):
        super().__init__(device, torch_dtype, scheduler)
        self.units = [WanShapeChecker(), WanNoiseInitializer(), WanInputVideoEmbedder(), WanPromptEmbedder(),
                      *(cls() for cls in DANCER_UNITS)]
        self.framewise = False  # how the latents of the last call decode

    @classmethod
    def claims(cls, context) -> bool:
        return is_dancer(context) or context.has("wantodance_music_path", "wantodance_keyframes",
                                                 "wantodance_reference_image")

    @classmethod
    def check_run(cls, context, features):
        if context.config("dit") is not None and not is_dancer(context):
            raise UserError("the wantodance_* inputs are Wan-Dancer's: its DiT (Wan-AI/Wan-Dancer-14B "
                            "global_model / local_model .safetensors) is not among the models")
        if context.has("wantodance_keyframes") and not context.has("wantodance_keyframes_mask"):
            raise UserError("--extra_inputs wantodance_keyframes needs wantodance_keyframes_mask too (which frames "
                            "are keyframes)")
        if context.has("wantodance_music_path") and not has_librosa():
            raise UserError(LIBROSA_MISSING)

    @classmethod
    def data_operators(cls, config) -> dict:
        from ...data.audio import audio_path_operator

        return {"wantodance_music_path": audio_path_operator(config.dataset_base_path)}

    def training_inputs(self, data: dict[str, Any]) -> dict[str, Any]:
        """As Wan's, with the Dancer's columns; a clip of a row with a true framewise_decoding may have any number
        of frames, which stand for 4 (n - 1) + 1 (`framewise_num_frames`)."""
        row = data.get("_row", "?")
        framewise = bool(data.get("framewise_decoding"))
        video = data.get("video") if data.get("video") is not None else data.get("image")
        frames = frames_of(video)
        if framewise and frames and (len(frames) - 1) % 4:  # the base checks 4k+1: give it a count it takes
            values = super().training_inputs({**data, "video": frames[:1], "image": None})
            values.update(input_video=frames)
        else:
            values = super().training_inputs(data)
        if framewise:
            values["num_frames"] = framewise_num_frames(len(frames))
        values["wantodance_keyframes_mask"] = as_list(data.get("wantodance_keyframes_mask"),
                                                      "wantodance_keyframes_mask", row)
        values["framewise_decoding"] = framewise
        return values

    def model_fn(self, latents, timestep, prompt_embeds, image_embeds=None, condition=None,
                 wantodance_refimage_feature=None, music_feature=None, wantodance_fps=None, skip_9th_layer=None,
                 **settings):
        settings.pop("expert_boundary", None)
        return model_fn_wan_dancer(self.dit, latents, timestep, prompt_embeds, image_embeds, condition,
                                   wantodance_refimage_feature, music_feature, wantodance_fps,
                                   skip_9th_layer=bool(skip_9th_layer), **settings)

    # guidance: the negative pass skips block 9 (the reference's skip_9th_layer)
    def model_fn_kwargs(self, values):
        return {**super().model_fn_kwargs(values), "skip_9th_layer": values.get("skip_9th_layer")}

    def negative_name(self, name: str) -> str:
        return "negative_skip_9th_layer" if name == "skip_9th_layer" else super().negative_name(name)

    def denoise(self, values, cfg_scale=1.0, progress=True, settings=None):
        values["negative_skip_9th_layer"] = bool(getattr(self.dit.config, "enable_global", False))
        return super().denoise(values, cfg_scale=cfg_scale, progress=progress, settings=settings)

    def finish_latents(self, latents, values):
        self.framewise = bool(values.get("framewise_decoding"))
        return super().finish_latents(latents, values)

    def decode(self, latents):
        if not self.framewise:
            return super().decode(latents)
        video = torch.cat([vae_decode(self, latents[:, :, t:t + 1]) for t in range(latents.shape[2])], dim=2)
        return video[:, :, 0] if video.shape[2] == 1 else video

    def postprocess(self, latents, output_type="pil"):
        if output_type == "latent" or not self.framewise:
            return super().postprocess(latents, output_type)
        from ...media.video import tensor_to_clips

        video = torch.cat([vae_decode(self, latents[:, :, t:t + 1]) for t in range(latents.shape[2])], dim=2)
        return (video.float() / 2 + 0.5).clamp(0, 1) if output_type == "pt" else tensor_to_clips(video)


__all__ = ["WanDancerPipeline", "WanDancerFps", "DANCER", "DANCER_14B_CONFIG", "DANCER_DIT", "DANCER_FRAMEWISE",
           "DANCER_UNITS", "FEATURE", "FRAMEWISE", "WanDancerFramewiseVideo", "WanDancerKeyframes", "WanDancerMusic",
           "WanDancerReferenceImage", "WanDancerTransformer", "dancer_from_original", "dancer_to_original",
           "framewise_num_frames", "global_frame_rope", "infer_dancer_config", "keyframe_mask", "model_fn_wan_dancer",
           "music_features"]
