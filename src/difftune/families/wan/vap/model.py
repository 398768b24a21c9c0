"""Video-As-Prompt's models: the Wan I2V DiT under the released config's class name, and the branch
(`WanVAPModel`, the reference's MotWanModel, Wan's blocks in their original names) whose blocks join the DiT's
self-attention (`joint_block`, `model_fn_wan_vap`)."""

from __future__ import annotations

from typing import Any

import torch
from diffusers import WanTransformer3DModel
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from ....core.checkpointing import gradient_checkpoint_forward
from ....errors import UserError
from ..layers import (ImageMLP, WanBlock, add_wan_embeddings, attend, diffusers_conditions, diffusers_inputs,
                      diffusers_output, diffusers_self_qkv, modulate, modulated_ffn, pair_tables, rope_grid_angles,
                      sinusoidal)

VAP_MOT_LAYERS = [0, 4, 8, 12, 16, 20, 24, 28, 32, 36]


class WanTransformer3DMOTModel(WanTransformer3DModel):
    """diffusers' Wan DiT under the released VAP config's class name (its `_mot_ref` part is the `vap` slot)."""


class WanVAPModel(ModelMixin, ConfigMixin):
    """The Video-As-Prompt branch (the reference's MotWanModel): its own patch, time, text and image embeddings
    and one block beside each DiT block in `mot_layers`."""

    _supports_gradient_checkpointing = True

    @register_to_config
    def __init__(self, mot_layers=tuple(VAP_MOT_LAYERS), patch_size=(1, 2, 2), has_image_input: bool = True,
                 dim: int = 5120, num_heads: int = 40, ffn_dim: int = 13824, freq_dim: int = 256,
                 text_dim: int = 4096, in_dim: int = 36, image_dim: int = 1280, eps: float = 1e-6):
        super().__init__()
        add_wan_embeddings(self, dim, in_dim, text_dim, freq_dim, patch_size)
        if has_image_input:
            self.img_emb = ImageMLP(image_dim, dim)
        self.blocks = nn.ModuleList([WanBlock(dim, num_heads, ffn_dim, eps, has_image_input) for _ in mot_layers])
        self.layer_of = {int(block): n for n, block in enumerate(mot_layers)}  # DiT block -> branch block

    @property
    def head_dim(self) -> int:
        return self.config.dim // self.config.num_heads


def joint_block(block, vblock: WanBlock, x, context, temb, rope, x_vap, context_vap, temb_vap, rope_vap,
                image_tokens_vap: int):
    """One diffusers Wan block and its branch block: the self-attention of both token sets is one attention
    over the two (each side with its own projections, norms and RoPE); cross-attention and FFN stay apart.
    `rope`: diffusers' tables; `rope_vap`: the branch's (cos, sin) per channel pair."""
    shift, scale, gate, c_shift, c_scale, c_gate = (block.scale_shift_table + temb.float()).chunk(6, dim=1)
    vshift, vscale, vgate, vc_shift, vc_scale, vc_gate = (vblock.modulation + temb_vap.float()).chunk(6, dim=1)
    attn, va = block.attn1, vblock.self_attn
    q, k, v = diffusers_self_qkv(attn, modulate(block.norm1, x, shift, scale), pair_tables(rope))
    qv, kv, vv = va.qkv(modulate(vblock.norm1, x_vap, vshift, vscale), rope=rope_vap)
    joint = attend(torch.cat([q, qv], dim=1), torch.cat([k, kv], dim=1), torch.cat([v, vv], dim=1))
    out, out_vap = joint[:, :q.shape[1]].type_as(x), joint[:, q.shape[1]:].type_as(x_vap)
    x = (x.float() + attn.to_out[1](attn.to_out[0](out)) * gate).type_as(x)
    x_vap = (x_vap.float() + va.o(out_vap) * vgate).type_as(x_vap)
    # the DiT's cross-attention and FFN, as diffusers' block runs them
    x = x + block.attn2(block.norm2(x.float()).type_as(x), context, None, None)
    x = modulated_ffn(block.norm3, block.ffn, x, c_shift, c_scale, c_gate)
    # the branch's
    x_vap = x_vap + vblock.cross_attn(vblock.norm3(x_vap), context_vap, image_tokens=image_tokens_vap)
    return x, modulated_ffn(vblock.norm2, vblock.ffn, x_vap, vc_shift, vc_scale, vc_gate)


def model_fn_wan_vap(dit, vap: WanVAPModel | None, latents: torch.Tensor, timestep: torch.Tensor,
                     prompt_embeds: torch.Tensor, image_embeds: torch.Tensor | None = None,
                     condition: torch.Tensor | None = None, vap_hidden_state: torch.Tensor | None = None,
                     vap_clip_feature: torch.Tensor | None = None, context_vap: torch.Tensor | None = None,
                     use_gradient_checkpointing: bool = False, use_gradient_checkpointing_offload: bool = False,
                     **_: Any) -> torch.Tensor:
    """Wan2.1 I2V DiT call (diffusers' `WanTransformer3DModel`, step by step) with the Video-As-Prompt branch
    joining the self-attention of its blocks."""
    if vap is None or vap_hidden_state is None:
        raise UserError("Video-As-Prompt needs its branch and a reference clip: --extra_inputs vap_video")
    if context_vap is None or vap_clip_feature is None:
        raise UserError("Video-As-Prompt needs the reference clip's CLIP and prompt embeddings (image and text "
                        "encoders loaded)")
    x, dtype, grid = diffusers_inputs(dit, latents, condition)
    b = latents.shape[0]
    rope = dit.rope(x)
    hidden = dit.patch_embedding(x).flatten(2).transpose(1, 2).contiguous()
    temb, tproj, context, _ = diffusers_conditions(dit, timestep, prompt_embeds, image_embeds, b, x.device, dtype)
    # the branch: its tokens, timestep 1, frames before the clip's
    vc = vap.config
    vdtype = vap.dtype if vap.dtype.is_floating_point else dtype
    x_vap = vap.patch_embedding(vap_hidden_state.to(vdtype)).flatten(2).transpose(1, 2)
    vgrid = tuple(n // p for n, p in zip(vap_hidden_state.shape[2:], vc.patch_size))
    if vgrid != grid:
        raise UserError(f"the Video-As-Prompt clip's latents {tuple(vap_hidden_state.shape[2:])} differ from the "
                        f"clip's {tuple(latents.shape[2:])}: give vap_video as many frames and the same size")
    temb_vap = vap.time_embedding(sinusoidal(vc.freq_dim, torch.ones(b, device=x.device)).to(vdtype))
    tproj_vap = vap.time_projection(temb_vap).unflatten(1, (6, vc.dim))
    angles = rope_grid_angles(vap.head_dim, grid, frame0=-grid[0])
    rope_vap = tuple(t[None, :, None].to(x.device) for t in (angles.cos(), angles.sin()))
    image_tokens = vap_clip_feature.shape[1] if vc.has_image_input else 0
    ctx_vap = vap.text_embedding(context_vap.to(vdtype))
    if vc.has_image_input:
        ctx_vap = torch.cat([vap.img_emb(vap_clip_feature.to(vdtype)), ctx_vap], dim=1)
    for i, block in enumerate(dit.blocks):
        if i in vap.layer_of:
            hidden, x_vap = gradient_checkpoint_forward(
                joint_block, use_gradient_checkpointing, use_gradient_checkpointing_offload, block,
                vap.blocks[vap.layer_of[i]], hidden, context, tproj, rope, x_vap, ctx_vap, tproj_vap, rope_vap,
                image_tokens)
        else:
            hidden = gradient_checkpoint_forward(block, use_gradient_checkpointing, use_gradient_checkpointing_offload,
                                                 hidden, context, tproj, rope)
    return diffusers_output(dit, hidden, temb, grid)


__all__ = ["VAP_MOT_LAYERS", "WanTransformer3DMOTModel", "WanVAPModel", "joint_block", "model_fn_wan_vap"]
