"""Wan2.2-S2V's DiT, `WanModel_S2V`, and its call (`model_fn_wan_s2v`).

diffusers has no S2V transformer, so it is written here from the published architecture (Wan-AI's
`wan/modules/s2v/model_s2v.py`, as the reference runs it: `diffsynth/models/wan_video_dit_s2v.py`), with the
released file's own key names (`blocks.N.self_attn.q`, `casual_audio_encoder.*`, `audio_injector.*`,
`frame_packer.*`, ...), so `Wan-AI/Wan2.2-S2V-14B/diffusion_pytorch_model*.safetensors` loads as it is; Wan's
layers are the family's (`..layers`)."""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from ....core.checkpointing import gradient_checkpoint_forward
from ....errors import UserError
from ..layers import (Head, WanAttention, WanBlock, add_wan_embeddings, layer_norm, rope_grid_angles, sinusoidal,
                      unpatchify)

MOTION_FRAMES = (73, 19)  # motion frames before the clip: video frames, and the audio encoder's frames for them
REFERENCE_FRAME = 30  # the RoPE frame position of the reference image's tokens


class S2VBlock(WanBlock):
    """A Wan DiT block whose modulation is per token group: the clip's tokens at the sample's timestep, the
    reference (and motion) tokens at timestep 0. RoPE is computed in float64, as Wan-AI's code."""

    def __init__(self, dim: int, heads: int, ffn_dim: int, eps: float):
        super().__init__(dim, heads, ffn_dim, eps, rope_dtype=torch.float64)

    def forward(self, x, context, mod_x, mod_rest, seq_len_x: int, rope):
        # mod_*: (B or 1, 6, dim); tokens [:seq_len_x] take mod_x, the others mod_rest
        rest = x.shape[1] - seq_len_x
        n = x.shape[0]
        params = [torch.cat([a[:, None].expand(n, seq_len_x, -1), r[:, None].expand(n, rest, -1)], dim=1)
                  for a, r in zip((self.modulation + mod_x).unbind(1), (self.modulation + mod_rest).unbind(1))]
        shift_msa, scale_msa, gate_msa, shift_mlp, scale_mlp, gate_mlp = params
        x = x + gate_msa * self.self_attn(self.norm1(x) * (1 + scale_msa) + shift_msa, rope=rope)
        x = x + self.cross_attn(self.norm3(x), context)
        return x + gate_mlp * self.ffn(self.norm2(x) * (1 + scale_mlp) + shift_mlp)


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
        self.norm1, self.norm2, self.norm3 = layer_norm(hidden // 4), layer_norm(hidden // 2), layer_norm(hidden)
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
        self.norm = layer_norm(dim, 1e-5)

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
        add_wan_embeddings(self, dim, in_dim, text_dim, freq_dim, patch_size)
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
    angles = torch.cat([rope_grid_angles(dit.head_dim, (f, h, w)),
                        rope_grid_angles(dit.head_dim, (1, rh, rw), frame0=REFERENCE_FRAME)]).to(x.device)
    rope = angles.cos()[None, :, None], angles.sin()[None, :, None]
    group = torch.cat([torch.zeros(seq_len_x, dtype=torch.long), torch.ones(rh * rw, dtype=torch.long)])
    x = x + dit.trainable_cond_mask(group.to(x.device)).to(x.dtype)[None]
    t = timestep.to(x.device).reshape(-1).expand(b)
    emb = dit.time_embedding(sinusoidal(c.freq_dim, torch.cat([t, t.new_zeros(1)])).to(dtype))
    mods = dit.time_projection(emb).unflatten(1, (6, c.dim))
    mod_x, mod_rest = mods[:-1], mods[-1:]
    for i, block in enumerate(dit.blocks):
        x = gradient_checkpoint_forward(block, use_gradient_checkpointing, use_gradient_checkpointing_offload,
                                        x, context, mod_x, mod_rest, seq_len_x, rope)
        x = dit.inject_audio(i, x, glob, local, seq_len_x)
    out = unpatchify(dit.head(x[:, :seq_len_x], emb[:-1]), (f, h, w), c.patch_size)
    return torch.cat([ref.to(out.dtype).expand(b, -1, -1, -1, -1), out], dim=2)


__all__ = ["MOTION_FRAMES", "REFERENCE_FRAME", "S2VBlock", "S2V_INJECT_LAYERS", "WanModel_S2V", "model_fn_wan_s2v"]
