"""Wan2.2-S2V-14B (speech-to-video): its DiT, its wav2vec2 audio features, its units and model_fn.

diffusers has no S2V transformer, so `WanModel_S2V` is written here from the published architecture (Wan-AI's
`wan/modules/s2v/model_s2v.py`, as the reference runs it: `diffsynth/models/wan_video_dit_s2v.py`), with the
released file's own key names (`blocks.N.self_attn.q`, `casual_audio_encoder.*`, `audio_injector.*`,
`frame_packer.*`, ...), so `Wan-AI/Wan2.2-S2V-14B/diffusion_pytorch_model*.safetensors` loads as it is. The class
carries the released config.json's class name, so that file configures it; bare files are recognised from their
shapes (`infer_s2v_config`).

Training, as the reference's `lora|full/Wan2.2-S2V-14B.sh`:
  * `input_image` (the clip's first frame): its VAE latents stand as the clean first latent frame (the
    reference image; left out of the loss, as TI2V-5B's first frame);
  * `input_audio` (an audio file, or a clip's audio track): wav2vec2's hidden states of every layer, at 30 per
    second, one per video frame at 16 fps (`s2v_audio_embeds`), (1, layers, 1024, num_frames - 1);
  * `s2v_pose_video` (a clip): its VAE latents, added to the patch embedding through `cond_encoder`;
  * motion frames: the reference encodes 73 black frames and then drops them (`drop_motion_frames`), so they
    change nothing in training; here they are not computed (`motion_latents` stays None).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from ...core.checkpointing import gradient_checkpoint_forward
from ...core.family import TokenizerSpec
from ...core.features import Feature
from ...core.units import PipelineUnit
from ...errors import UserError
from ...models.detect import ComponentSpec
from .units import (WanInputVideoEmbedder, WanNoiseInitializer, WanPromptEmbedder, WanShapeChecker, frames_of,
                    vae_encode, vae_scales, video_tensor)
from .variant import WanVariantPipeline, dit_class

FEATURE = "s2v"
AUDIO_RATE = 16000  # the reference's LoadAudio(sr=16000) and audio_sample_rate
AUDIO_FEATURE_RATE = 30  # wav2vec2's 50 features a second, interpolated to 30 (the encoder's video_rate)
VIDEO_FPS = 16  # the frame rate the audio features are sampled at
# wav2vec2's convolutions span 400 samples (25 ms at 16 kHz) before its first feature
S2V_MIN_AUDIO_SECONDS = 0.025
MOTION_FRAMES = (73, 19)  # motion frames before the clip: video frames, and the audio encoder's frames for them
REFERENCE_FRAME = 30  # the RoPE frame position of the reference image's tokens


# -- the model ------------------------------------------------------------------------------------------

def sinusoidal(dim: int, position: torch.Tensor) -> torch.Tensor:
    """Wan's timestep embedding: [cos, sin] of position * 10000^(-i / (dim/2)), computed in float64."""
    half = dim // 2
    freqs = torch.pow(10000.0, -torch.arange(half, dtype=torch.float64, device=position.device) / half)
    angles = position.to(torch.float64)[:, None] * freqs[None]
    return torch.cat([torch.cos(angles), torch.sin(angles)], dim=1)


def rope_angles(head_dim: int, positions: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """(tokens, head_dim / 2) rotation angles of 3-D positions (tokens, 3): Wan's split of a head's channels over
    frame, height and width (d - 2 (d // 3), d // 3, d // 3 of d = head_dim), each axis with the frequencies
    theta^(-2i / its channels)."""
    sizes = (head_dim - 2 * (head_dim // 3), head_dim // 3, head_dim // 3)
    parts = []
    for axis, dim in enumerate(sizes):
        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float64)[:dim // 2] / dim))
        parts.append(positions[:, axis:axis + 1].to(torch.float64) * inv[None])
    return torch.cat(parts, dim=1)


def grid_positions(f: int, h: int, w: int, frame0: int = 0) -> torch.Tensor:
    ff, hh, ww = torch.meshgrid(torch.arange(frame0, frame0 + f), torch.arange(h), torch.arange(w), indexing="ij")
    return torch.stack([ff.flatten(), hh.flatten(), ww.flatten()], dim=1)


def apply_rope(x: torch.Tensor, angles: torch.Tensor, heads: int) -> torch.Tensor:
    """Rotate consecutive pairs of each head's channels (Wan's complex-number RoPE), in float64."""
    b, s, c = x.shape
    pairs = x.to(torch.float64).reshape(b, s, heads, -1, 2)
    cos, sin = angles.cos()[None, :, None], angles.sin()[None, :, None]
    real, imag = pairs[..., 0], pairs[..., 1]
    out = torch.stack([real * cos - imag * sin, real * sin + imag * cos], dim=-1)
    return out.reshape(b, s, c).to(x.dtype)


def attention(q, k, v, heads: int) -> torch.Tensor:
    b = q.shape[0]
    q, k, v = (t.reshape(b, t.shape[1], heads, -1).transpose(1, 2) for t in (q, k, v))
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2)


class RMSNorm(nn.Module):
    """Wan's RMSNorm: normalised in float32, scaled in the input's dtype."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight


class WanAttention(nn.Module):
    """Wan's attention in its original names (q, k, v, o, norm_q, norm_k); self-attention takes RoPE angles."""

    def __init__(self, dim: int, heads: int, eps: float = 1e-6):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q, self.norm_k = RMSNorm(dim, eps), RMSNorm(dim, eps)

    def forward(self, x, context=None, angles=None):
        context = x if context is None else context
        q, k, v = self.norm_q(self.q(x)), self.norm_k(self.k(context)), self.v(context)
        if angles is not None:
            q, k = apply_rope(q, angles, self.heads), apply_rope(k, angles, self.heads)
        return self.o(attention(q, k, v, self.heads))


def _ln(dim: int, eps: float = 1e-6, affine: bool = False) -> nn.LayerNorm:
    return nn.LayerNorm(dim, eps=eps, elementwise_affine=affine)


class S2VBlock(nn.Module):
    """A Wan DiT block whose modulation is per token group: the clip's tokens at the sample's timestep, the
    reference (and motion) tokens at timestep 0."""

    def __init__(self, dim: int, heads: int, ffn_dim: int, eps: float):
        super().__init__()
        self.self_attn, self.cross_attn = WanAttention(dim, heads, eps), WanAttention(dim, heads, eps)
        self.norm1, self.norm2, self.norm3 = _ln(dim, eps), _ln(dim, eps), _ln(dim, eps, affine=True)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(ffn_dim, dim))
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim ** 0.5)

    def forward(self, x, context, mod_x, mod_rest, seq_len_x: int, angles):
        # mod_*: (B or 1, 6, dim); tokens [:seq_len_x] take mod_x, the others mod_rest
        rest = x.shape[1] - seq_len_x
        n = x.shape[0]
        params = [torch.cat([a[:, None].expand(n, seq_len_x, -1), r[:, None].expand(n, rest, -1)], dim=1)
                  for a, r in zip((self.modulation + mod_x).unbind(1), (self.modulation + mod_rest).unbind(1))]
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = params
        x = x + gate_msa * self.self_attn(self.norm1(x) * (1 + scale_msa) + shift_msa, angles=angles)
        x = x + self.cross_attn(self.norm3(x), context)
        return x + gate_mlp * self.ffn(self.norm2(x) * (1 + scale_mlp) + shift_mlp)


class Head(nn.Module):
    def __init__(self, dim: int, out: int, eps: float):
        super().__init__()
        self.norm = _ln(dim, eps)
        self.head = nn.Linear(dim, out)
        self.modulation = nn.Parameter(torch.randn(1, 2, dim) / dim ** 0.5)

    def forward(self, x, t):
        shift, scale = (self.modulation + t[:, None]).unbind(1)
        return self.head(self.norm(x) * (1 + scale[:, None]) + shift[:, None])


class CausalConv1d(nn.Module):
    def __init__(self, cin: int, cout: int, kernel: int = 3, stride: int = 1):
        super().__init__()
        self.pad = kernel - 1
        self.conv = nn.Conv1d(cin, cout, kernel, stride=stride)

    def forward(self, x):
        return self.conv(F.pad(x, (self.pad, 0), mode="replicate"))


class MotionEncoder(nn.Module):
    """The causal audio encoder's convolutions: per-frame tokens for each of `tokens` heads (local) and, with
    `need_global`, one global token per frame (its AdaIN input). Frames are downsampled x4 in time."""

    def __init__(self, in_dim: int, hidden: int, tokens: int, need_global: bool):
        super().__init__()
        self.tokens, self.need_global = tokens, need_global
        self.conv1_local = CausalConv1d(in_dim, hidden // 4 * tokens)
        if need_global:
            self.conv1_global = CausalConv1d(in_dim, hidden // 4)
            self.final_linear = nn.Linear(hidden, hidden)
        self.conv2 = CausalConv1d(hidden // 4, hidden // 2, stride=2)
        self.conv3 = CausalConv1d(hidden // 2, hidden, stride=2)
        self.norm1, self.norm2, self.norm3 = _ln(hidden // 4), _ln(hidden // 2), _ln(hidden)
        self.padding_tokens = nn.Parameter(torch.zeros(1, 1, 1, hidden))

    def _down(self, x):
        # (N, C, T) -> (N, T', hidden) through conv2 / conv3, each followed by LayerNorm and SiLU
        x = F.silu(self.norm2(self.conv2(x).transpose(1, 2)))
        return F.silu(self.norm3(self.conv3(x.transpose(1, 2)).transpose(1, 2)))

    def forward(self, x):  # (B, T, C)
        b = x.shape[0]
        seq = x.transpose(1, 2)
        local = self.conv1_local(seq)  # (B, tokens * hidden/4, T): heads split off the channels
        local = local.reshape(b, self.tokens, -1, local.shape[-1]).flatten(0, 1)
        local = F.silu(self.norm1(local.transpose(1, 2))).transpose(1, 2)
        local = self._down(local)  # (B * tokens, T', hidden)
        local = local.reshape(b, self.tokens, *local.shape[1:]).transpose(1, 2)  # (B, T', tokens, hidden)
        local = torch.cat([local, self.padding_tokens.expand(b, local.shape[1], 1, -1).to(local.dtype)], dim=2)
        if not self.need_global:
            return None, local
        glob = F.silu(self.norm1(self.conv1_global(seq).transpose(1, 2))).transpose(1, 2)
        glob = self.final_linear(self._down(glob))[:, :, None]  # (B, T', 1, hidden)
        return glob, local


class CausalAudioEncoder(nn.Module):
    """A learnt softmax-free mix of wav2vec2's layers (SiLU weights, normalised to sum 1), then `MotionEncoder`."""

    def __init__(self, audio_dim: int, layers: int, out_dim: int, tokens: int, need_global: bool):
        super().__init__()
        self.weights = nn.Parameter(torch.ones(1, layers, 1, 1) * 0.01)
        self.encoder = MotionEncoder(audio_dim, out_dim, tokens, need_global)

    def forward(self, features):  # (B, layers, audio_dim, T)
        w = F.silu(self.weights.to(features.dtype))
        mixed = (features * w / w.sum(dim=1, keepdim=True)).sum(dim=1)  # (B, audio_dim, T)
        return self.encoder(mixed.transpose(1, 2))


class AdaLayerNorm(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, 2 * dim)
        self.norm = _ln(dim, 1e-5)

    def forward(self, x, temb):
        shift, scale = self.linear(F.silu(temb)).chunk(2, dim=1)
        return self.norm(x) * (1 + scale[:, None]) + shift[:, None]


class AudioInjector(nn.Module):
    """Cross-attention from each latent frame's tokens to that frame's audio tokens, after the blocks listed in
    `audio_inject_layers` (AdaIN-normalised by the frame's global audio token)."""

    def __init__(self, dim: int, heads: int, count: int, enable_adain: bool):
        super().__init__()
        self.injector = nn.ModuleList([WanAttention(dim, heads) for _ in range(count)])
        if enable_adain:
            self.injector_adain_layers = nn.ModuleList([AdaLayerNorm(dim) for _ in range(count)])


class FramePackMotioner(nn.Module):
    """The motion-frame packer (1x, 2x, 4x compressed patches of the latest motion latents). Its weights are in
    the released file; training drops the motion frames (the reference's `drop_motion_frames`), so it is not
    run here."""

    def __init__(self, dim: int, channels: int = 16):
        super().__init__()
        self.proj = nn.Conv3d(channels, dim, kernel_size=(1, 2, 2), stride=(1, 2, 2))
        self.proj_2x = nn.Conv3d(channels, dim, kernel_size=(2, 4, 4), stride=(2, 4, 4))
        self.proj_4x = nn.Conv3d(channels, dim, kernel_size=(4, 8, 8), stride=(4, 8, 8))


S2V_INJECT_LAYERS = [0, 4, 8, 12, 16, 20, 24, 27, 30, 33, 36, 39]


class WanModel_S2V(ModelMixin, ConfigMixin):  # noqa: N801 - the released config.json's class name
    """Wan2.2-S2V's DiT, in the released file's key names; its config names are the released config.json's."""

    _supports_gradient_checkpointing = True
    _no_split_modules = ["S2VBlock"]

    @register_to_config
    def __init__(self, dim: int = 5120, in_dim: int = 16, ffn_dim: int = 13824, out_dim: int = 16,
                 text_dim: int = 4096, freq_dim: int = 256, eps: float = 1e-6, patch_size=(1, 2, 2),
                 num_heads: int = 40, num_layers: int = 40, cond_dim: int = 16, audio_dim: int = 1024,
                 num_audio_token: int = 4, audio_layers: int = 25, enable_adain: bool = True,
                 audio_inject_layers=tuple(S2V_INJECT_LAYERS), enable_framepack: bool = True,
                 framepack_drop_mode: str = "padd", zero_timestep: bool = True, enable_motioner: bool = False,
                 model_type: str = "s2v"):
        super().__init__()
        if enable_motioner:
            raise UserError("Wan2.2-S2V with the transformer motioner (enable_motioner) is not supported; the "
                            "released model uses the frame packer (enable_framepack)")
        self.patch_embedding = nn.Conv3d(in_dim, dim, kernel_size=tuple(patch_size), stride=tuple(patch_size))
        self.text_embedding = nn.Sequential(nn.Linear(text_dim, dim), nn.GELU(approximate="tanh"),
                                            nn.Linear(dim, dim))
        self.time_embedding = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, dim * 6))
        self.blocks = nn.ModuleList([S2VBlock(dim, num_heads, ffn_dim, eps) for _ in range(num_layers)])
        self.head = Head(dim, out_dim * math.prod(patch_size), eps)
        if cond_dim > 0:
            self.cond_encoder = nn.Conv3d(cond_dim, dim, kernel_size=tuple(patch_size), stride=tuple(patch_size))
        self.casual_audio_encoder = CausalAudioEncoder(audio_dim, audio_layers, dim, num_audio_token, enable_adain)
        inject = [i for i in audio_inject_layers if 0 <= i < num_layers]
        self.audio_injector = AudioInjector(dim, num_heads, len(inject), enable_adain)
        self.trainable_cond_mask = nn.Embedding(3, dim)
        if enable_framepack:
            self.frame_packer = FramePackMotioner(dim)
        self.injected = {block: n for n, block in enumerate(inject)}  # block index -> injector index
        self.gradient_checkpointing = False

    @property
    def head_dim(self) -> int:
        return self.config.dim // self.config.num_heads

    def audio_tokens(self, audio_embeds: torch.Tensor):
        """(B, layers, audio_dim, F-1) -> per latent frame: global (B, f, 1, dim) and local (B, f, tokens+1, dim)
        tokens, the motion frames' leading audio (73 copies of the first feature) encoded and then cut off."""
        lead = audio_embeds[..., :1].expand(*audio_embeds.shape[:-1], MOTION_FRAMES[0])
        glob, local = self.casual_audio_encoder(torch.cat([lead, audio_embeds], dim=-1))
        cut = MOTION_FRAMES[1]
        return (None if glob is None else glob[:, cut:]), local[:, cut:]

    def inject_audio(self, block: int, x: torch.Tensor, glob, local, seq_len_x: int) -> torch.Tensor:
        if block not in self.injected:
            return x
        n = self.injected[block]
        frames = local.shape[1]
        b = x.shape[0]
        tokens = x[:, :seq_len_x].reshape(b * frames, seq_len_x // frames, -1)
        if self.config.enable_adain:
            tokens = self.audio_injector.injector_adain_layers[n](tokens, glob.flatten(0, 1)[:, 0])
        out = self.audio_injector.injector[n](tokens, local.flatten(0, 1)).reshape(b, seq_len_x, -1)
        return torch.cat([x[:, :seq_len_x] + out, x[:, seq_len_x:]], dim=1)

    def unpatchify(self, x: torch.Tensor, f: int, h: int, w: int) -> torch.Tensor:
        pt, ph, pw = self.config.patch_size
        b = x.shape[0]
        x = x.reshape(b, f, h, w, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
        return x.reshape(b, -1, f * pt, h * ph, w * pw)


def model_fn_wan_s2v(dit: WanModel_S2V, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor,
                     audio_embeds: torch.Tensor | None = None, s2v_pose_latents: torch.Tensor | None = None,
                     first_frame_latents: torch.Tensor | None = None, motion_latents: torch.Tensor | None = None,
                     use_gradient_checkpointing: bool = False, use_gradient_checkpointing_offload: bool = False,
                     **_: Any) -> torch.Tensor:
    """One S2V DiT call on (B, 16, F, h, w) latents whose first frame is the reference image (`first_frame_latents`
    when given, else the latents' own first frame, as the reference); returns the velocity of frames 1.. behind
    the reference frame unchanged (the loss leaves frame 0 out)."""
    if audio_embeds is None:
        raise UserError("Wan2.2-S2V needs audio: give an input_audio column (--extra_inputs input_audio)")
    if motion_latents is not None:
        raise UserError("Wan2.2-S2V motion frames (motion_video) are not supported yet; train and sample without")
    c = dit.config
    dtype = dit.dtype if dit.dtype.is_floating_point else latents.dtype
    ref = latents[:, :, :1] if first_frame_latents is None else first_frame_latents.to(latents.dtype)
    x = latents[:, :, 1:].to(dtype)
    b = x.shape[0]
    context = dit.text_embedding(prompt_embeds.to(dtype))
    glob, local = dit.audio_tokens(audio_embeds.to(dtype))
    pose = torch.zeros_like(x) if s2v_pose_latents is None else s2v_pose_latents.to(dtype)
    x = dit.patch_embedding(x)
    if hasattr(dit, "cond_encoder"):
        x = x + dit.cond_encoder(pose)
    f, h, w = x.shape[2:]
    x = x.flatten(2).transpose(1, 2)
    seq_len_x = x.shape[1]
    r = dit.patch_embedding(ref.to(dtype).expand(b, -1, -1, -1, -1))
    rh, rw = r.shape[3:]
    x = torch.cat([x, r.flatten(2).transpose(1, 2)], dim=1)
    # positions: the clip's frames from 0, the reference at frame 30; token groups 0 (clip) and 1 (reference)
    positions = torch.cat([grid_positions(f, h, w), grid_positions(1, rh, rw, REFERENCE_FRAME)])
    angles = rope_angles(dit.head_dim, positions).to(x.device)
    group = torch.cat([torch.zeros(seq_len_x, dtype=torch.long), torch.ones(rh * rw, dtype=torch.long)])
    x = x + dit.trainable_cond_mask(group.to(x.device)).to(x.dtype)[None]
    t = timestep.to(x.device).reshape(-1).expand(b)
    emb = dit.time_embedding(sinusoidal(c.freq_dim, torch.cat([t, t.new_zeros(1)])).to(dtype))
    mods = dit.time_projection(emb).unflatten(1, (6, c.dim))
    mod_x, mod_rest = mods[:-1], mods[-1:]
    for i, block in enumerate(dit.blocks):
        x = gradient_checkpoint_forward(block, use_gradient_checkpointing, use_gradient_checkpointing_offload,
                                        x, context, mod_x, mod_rest, seq_len_x, angles)
        x = dit.inject_audio(i, x, glob, local, seq_len_x)
    out = dit.unpatchify(dit.head(x[:, :seq_len_x], emb[:-1]), f, h, w)
    return torch.cat([ref.to(out.dtype).expand(b, -1, -1, -1, -1), out], dim=2)


# -- recognition ------------------------------------------------------------------------------------------

S2V_14B_CONFIG = {"_class_name": "WanModel_S2V", "dim": 5120, "in_dim": 16, "ffn_dim": 13824, "out_dim": 16,
                  "text_dim": 4096, "freq_dim": 256, "eps": 1e-6, "patch_size": [1, 2, 2], "num_heads": 40,
                  "num_layers": 40, "cond_dim": 16, "audio_dim": 1024, "num_audio_token": 4, "audio_layers": 25,
                  "enable_adain": True, "audio_inject_layers": S2V_INJECT_LAYERS, "enable_framepack": True,
                  "framepack_drop_mode": "padd", "zero_timestep": True}


def infer_s2v_config(shapes: dict[str, tuple[int, ...]]) -> dict | None:
    """A bare S2V DiT's config from its shapes (width, depth, audio sizes). The heads and the injected blocks do
    not show in shapes: 128-channel heads (Wan's), and the injectors after blocks 0, 4, 8, ... spread as the
    released list is (for 40 blocks exactly the released list)."""
    try:
        dim, in_dim = shapes["patch_embedding.weight"][:2]
        blocks = 1 + max(int(k.split(".")[1]) for k in shapes if k.startswith("blocks."))
        injectors = 1 + max((int(k.split(".")[2]) for k in shapes if k.startswith("audio_injector.injector.")),
                            default=-1)
        enc = shapes["casual_audio_encoder.encoder.conv1_local.conv.weight"]
        config = dict(S2V_14B_CONFIG, dim=dim, in_dim=in_dim, ffn_dim=shapes["blocks.0.ffn.0.weight"][0],
                      out_dim=shapes["head.head.weight"][0] // 4, text_dim=shapes["text_embedding.0.weight"][1],
                      freq_dim=shapes["time_embedding.0.weight"][1], num_layers=blocks,
                      num_heads=max(1, dim // 128), audio_dim=enc[1], num_audio_token=enc[0] // (dim // 4),
                      audio_layers=shapes["casual_audio_encoder.weights"][1],
                      cond_dim=shapes["cond_encoder.weight"][1] if "cond_encoder.weight" in shapes else 0,
                      enable_adain="casual_audio_encoder.encoder.final_linear.weight" in shapes,
                      enable_framepack="frame_packer.proj.weight" in shapes)
    except (KeyError, IndexError, ValueError):
        return None
    config["audio_inject_layers"] = S2V_INJECT_LAYERS if (blocks, injectors) == (40, 12) else \
        [round(i * (blocks - 1) / max(injectors - 1, 1)) for i in range(injectors)]
    return config


S2V_DIT = ComponentSpec(
    name="dit", library=__name__, class_name="WanModel_S2V", known_configs={"Wan2.2-S2V-14B": S2V_14B_CONFIG},
    marker_keys=("casual_audio_encoder.weights", "audio_injector.injector.0.q.weight", "blocks.0.self_attn.q.weight"),
    infer_config=infer_s2v_config,
    description="Wan2.2-S2V DiT (speech-to-video; Wan-AI's layout, diffusion_pytorch_model*.safetensors)")


# -- the audio encoder: transformers' wav2vec2 -------------------------------------------------------------

# facebook/wav2vec2-large-xlsr-53 fine-tuned for English (Wan-AI/Wan2.2-S2V-14B/wav2vec2-large-xlsr-53-english/)
WAV2VEC2_XLSR_CONFIG = {
    "architectures": ["Wav2Vec2ForCTC"], "model_type": "wav2vec2", "activation_dropout": 0.05,
    "apply_spec_augment": True, "attention_dropout": 0.1, "bos_token_id": 1, "conv_bias": True,
    "conv_dim": [512] * 7, "conv_kernel": [10, 3, 3, 3, 3, 2, 2], "conv_stride": [5, 2, 2, 2, 2, 2, 2],
    "ctc_loss_reduction": "mean", "ctc_zero_infinity": True, "do_stable_layer_norm": True, "eos_token_id": 2,
    "feat_extract_activation": "gelu", "feat_extract_dropout": 0.0, "feat_extract_norm": "layer",
    "feat_proj_dropout": 0.05, "final_dropout": 0.0, "hidden_act": "gelu", "hidden_dropout": 0.05,
    "hidden_size": 1024, "initializer_range": 0.02, "intermediate_size": 4096, "layer_norm_eps": 1e-5,
    "layerdrop": 0.05, "mask_time_length": 10, "mask_time_prob": 0.05, "num_attention_heads": 16,
    "num_conv_pos_embedding_groups": 16, "num_conv_pos_embeddings": 128, "num_feat_extract_layers": 7,
    "num_hidden_layers": 24, "pad_token_id": 0, "vocab_size": 33}


def wav2vec2_from_file(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The released wav2vec2 file (older transformers' weight-norm names) -> transformers 5's names."""
    rename = {"weight_g": "parametrizations.weight.original0", "weight_v": "parametrizations.weight.original1"}
    out = {}
    for key, value in state.items():
        head, _, leaf = key.rpartition(".")
        out[f"{head}.{rename[leaf]}" if "pos_conv_embed.conv" in head and leaf in rename else key] = value
    return out


AUDIO_ENCODER = ComponentSpec(
    name="audio_encoder", library="transformers", class_name="Wav2Vec2ForCTC", config_class_name="Wav2Vec2Config",
    known_configs={"wav2vec2-large-xlsr-53": WAV2VEC2_XLSR_CONFIG},
    marker_keys=("wav2vec2.feature_extractor.conv_layers.0.conv.weight",), convert_state_dict=wav2vec2_from_file,
    description="wav2vec2 audio encoder (Wan2.2-S2V: wav2vec2-large-xlsr-53-english/model.safetensors)")


def load_audio_processor(path_or_config):
    """The wav2vec2 feature extractor (preprocessor_config.json) of --audio_processor_path's folder; the
    tokenizer beside it is not needed for features."""
    from transformers import Wav2Vec2FeatureExtractor

    from ...models.load import model_directory
    from ...util import first_line

    path = model_directory(path_or_config, "audio processor")
    try:
        return Wav2Vec2FeatureExtractor.from_pretrained(str(path))
    except Exception as err:  # noqa: BLE001 - transformers raises many kinds for a bad folder
        raise UserError(f"{path}: cannot load the wav2vec2 audio processor ({first_line(err)})") from err


def audio_frame_indices(features: int, frames: int, fps: int = VIDEO_FPS, rate: int = AUDIO_FEATURE_RATE):
    """For each of `frames` video frames at `fps`, the audio feature (at `rate` a second) it takes: the one at its
    time, rounded half to even (numpy's round); None past the audio's end (a zero feature)."""
    times = np.linspace(0, frames / fps, frames, endpoint=False)
    index = np.round(times * rate).astype(int)
    return [int(i) if i < features else None for i in index]


def _receptive_field(encoder) -> int:
    """Samples wav2vec2's feature convolutions span before their first output."""
    span, step = 1, 1
    for k, s in zip(encoder.config.conv_kernel, encoder.config.conv_stride):
        span, step = span + (k - 1) * step, step * s
    return span


@torch.no_grad()
def s2v_audio_embeds(encoder, processor, waveform, num_frames: int, sample_rate: int = AUDIO_RATE,
                     fps: int = VIDEO_FPS) -> torch.Tensor:
    """A waveform -> (1, layers, hidden, num_frames - 1): every hidden state of wav2vec2 (the embedding output
    and each layer's), linearly interpolated from 50 to 30 a second (end points aligned), then one feature per
    generated video frame (`audio_frame_indices`), zeros past the audio's end."""
    span = _receptive_field(encoder)
    if np.shape(waveform)[-1] < span:
        n = np.shape(waveform)[-1]
        raise UserError(f"input_audio: {n} samples ({n / sample_rate:.2f} s) at {sample_rate} Hz; wav2vec2 needs "
                        f"at least {span} ({span / sample_rate:g} s)")
    values = processor(np.asarray(waveform, dtype=np.float32), sampling_rate=sample_rate,
                       return_tensors="pt").input_values
    param = next(encoder.parameters())
    hidden = encoder(values.to(param.device, param.dtype), output_hidden_states=True).hidden_states
    feats = torch.cat(hidden)  # (layers, T50, hidden)
    length = int(feats.shape[1] / 50 * AUDIO_FEATURE_RATE)
    feats = F.interpolate(feats.transpose(1, 2).float(), size=length, mode="linear", align_corners=True)
    feats = feats.transpose(1, 2)  # (layers, T30, hidden)
    frames = []
    for i in audio_frame_indices(feats.shape[1], num_frames - 1, fps):
        frames.append(feats[:, i] if i is not None else feats.new_zeros(feats.shape[0], feats.shape[2]))
    return torch.stack(frames, dim=-1)[None]  # (1, layers, hidden, F-1)


# -- units -------------------------------------------------------------------------------------------------

class WanS2VAudioEmbedder(PipelineUnit):
    """`input_audio` (a waveform at 16 kHz) -> wav2vec2's features per generated frame (`s2v_audio_embeds`)."""

    feature = FEATURE
    inputs = ("input_audio", "num_frames")
    outputs = ("audio_embeds",)
    models = ("audio_encoder",)

    def process(self, pipe, input_audio, num_frames):
        if input_audio is None:
            return {}
        processor = getattr(pipe, "audio_processor", None)
        if processor is None:
            raise UserError("Wan2.2-S2V needs the wav2vec2 audio processor: pass --audio_processor_path "
                            "(e.g. Wan-AI/Wan2.2-S2V-14B:wav2vec2-large-xlsr-53-english/)")
        waves = input_audio if isinstance(input_audio, (list, tuple)) else [input_audio]
        embeds = [s2v_audio_embeds(pipe.audio_encoder, processor, w, num_frames) for w in waves]
        return {"audio_embeds": torch.cat(embeds).to(pipe.device, pipe.torch_dtype)}


class WanS2VPoseEmbedder(PipelineUnit):
    """`s2v_pose_video` -> VAE latents of its first num_frames - 1 frames (padded with black, -1, if shorter),
    encoded behind a copy of its first frame whose latent frame is then dropped: (B, 16, (F-1)/4, h, w)."""

    feature = FEATURE
    inputs = ("s2v_pose_video", "num_frames", "height", "width")
    outputs = ("s2v_pose_latents",)
    models = ("vae",)

    def process(self, pipe, s2v_pose_video, num_frames, height, width):
        if s2v_pose_video is None:
            return {}
        clips = s2v_pose_video if s2v_pose_video and isinstance(s2v_pose_video, (list, tuple)) and \
            not hasattr(s2v_pose_video[0], "size") else [s2v_pose_video]
        out = []
        for clip in clips:
            video = video_tensor(frames_of(clip)[:num_frames - 1], height, width)
            short = num_frames - 1 - video.shape[2]
            if short > 0:
                video = torch.cat([video, -torch.ones(1, 3, short, height, width)], dim=2)
            z = vae_encode(pipe, torch.cat([video[:, :, :1], video], dim=2))
            out.append(z[:, :, 1:])
        return {"s2v_pose_latents": torch.cat(out).to(pipe.torch_dtype)}


class WanS2VReferenceEmbedder(PipelineUnit):
    """`input_image` -> its VAE latents, the clean reference frame in front of the clip's latents (the
    reference's fused first frame for a DiT that fuses it: S2V). Stands in for TI2V-5B's fused-image unit."""

    feature = FEATURE
    replaces = ("WanImageEmbedderFused",)
    inputs = ("input_image", "height", "width", "batch_size")
    outputs = ("first_frame_latents",)
    models = ("vae",)

    def process(self, pipe, input_image, height, width, batch_size):
        if input_image is None:
            return {}
        images = input_image if isinstance(input_image, (list, tuple)) else [input_image] * int(batch_size or 1)
        z = [vae_encode(pipe, video_tensor([im], height, width)) for im in images]
        return {"first_frame_latents": torch.cat(z).to(pipe.torch_dtype)}


# -- the feature (wired into the Wan family's S2V pipeline) ------------------------------------------------

AUDIO_PROCESSOR = TokenizerSpec(attr="audio_processor", slot="audio_encoder", folder="wav2vec2-large-xlsr-53-english",
                                load=load_audio_processor, flag="audio_processor_path")

S2V = Feature(name=FEATURE, columns=("input_audio", "s2v_pose_video"), models=("audio_encoder",),
              model_fn_inputs=("audio_embeds", "s2v_pose_latents", "first_frame_latents"),
              data_inputs=("input_audio", "s2v_pose_video", "input_image"),
              description="Wan2.2-S2V: speech (wav2vec2 features), pose clip and reference image")
S2V_UNITS = (WanS2VReferenceEmbedder, WanS2VAudioEmbedder, WanS2VPoseEmbedder)


def s2v_latent_frames(num_frames: int, vae) -> int:
    _, _, temporal = vae_scales(vae)
    return (num_frames - 1) // temporal + 1


# -- the pipeline ------------------------------------------------------------------------------------------

class WanS2VPipeline(WanVariantPipeline):
    """Wan2.2-S2V-14B: speech (and a pose clip) to video behind a reference image, with its own DiT
    (`WanModel_S2V`) and wav2vec2 audio encoder; `model_fn_wan_s2v`. Its runs: its DiT, a wav2vec2 encoder, or
    the S2V data columns."""

    model_names = (*WanVariantPipeline.model_names, "audio_encoder")
    features = (S2V,)
    own_inputs = ("input_audio", "s2v_pose_video")
    # the DiT is in Wan's own module names: the reference's q,k,v,o,ffn.0,ffn.2 as they are, diffusers' Wan names
    # (the family's default targets) onto them
    lora_target_aliases = {"dit": {"to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "o", "ffn.net.0.proj": "ffn.0",
                                   "ffn.net.2": "ffn.2"}}

    def __init__(self, device="cpu", torch_dtype=torch.float32, scheduler=None):
        super().__init__(device, torch_dtype, scheduler)
        self.audio_processor = None
        self.units = [WanShapeChecker(), WanNoiseInitializer(), WanInputVideoEmbedder(), WanPromptEmbedder(),
                      *(cls() for cls in S2V_UNITS)]

    @classmethod
    def claims(cls, context) -> bool:
        return dit_class(context) == "WanModel_S2V" or context.config("audio_encoder") is not None \
            or context.has("input_audio", "s2v_pose_video")

    @classmethod
    def check_run(cls, context, features):
        if dit_class(context) == "WanModel_S2V" and not context.has("input_audio"):
            raise UserError("Wan2.2-S2V needs audio: give an input_audio column (--extra_inputs input_audio)")
        if context.has("input_audio") and context.config("audio_encoder") is None:
            raise UserError("input_audio needs the wav2vec2 audio encoder: add Wan2.2-S2V-14B's "
                            "wav2vec2-large-xlsr-53-english/model.safetensors to the models")

    @classmethod
    def data_operators(cls, config) -> dict:
        from ...data.audio import audio_operator

        return {"input_audio": audio_operator(config.dataset_base_path, AUDIO_RATE,
                                              min_seconds=S2V_MIN_AUDIO_SECONDS)}

    def model_fn(self, latents, timestep, prompt_embeds, audio_embeds=None, s2v_pose_latents=None,
                 first_frame_latents=None, **settings):
        return model_fn_wan_s2v(self.dit, latents, timestep, prompt_embeds, audio_embeds, s2v_pose_latents,
                                first_frame_latents, **settings)

    # the negative side of guidance hears silence: the audio features times 0, as the reference
    def negative_name(self, name: str) -> str:
        return "negative_audio_embeds" if name == "audio_embeds" else super().negative_name(name)

    def denoise(self, values, cfg_scale=1.0, progress=True, settings=None):
        if values.get("audio_embeds") is not None and values.get("negative_audio_embeds") is None:
            values["negative_audio_embeds"] = values["audio_embeds"] * 0
        return super().denoise(values, cfg_scale=cfg_scale, progress=progress, settings=settings)


__all__ = ["WanS2VPipeline", "AUDIO_ENCODER", "AUDIO_PROCESSOR", "FEATURE", "S2V", "S2V_DIT", "S2V_UNITS",
           "S2V_14B_CONFIG", "WAV2VEC2_XLSR_CONFIG", "WanModel_S2V", "WanS2VAudioEmbedder", "WanS2VPoseEmbedder",
           "WanS2VReferenceEmbedder", "audio_frame_indices", "infer_s2v_config", "load_audio_processor",
           "model_fn_wan_s2v", "s2v_audio_embeds", "wav2vec2_from_file"]
