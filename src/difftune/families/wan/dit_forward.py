"""One call of diffusers' `WanTransformer3DModel`, step by step, with the places where Wan's variants add to it.

`WanTransformer3DModel.forward` runs patch embedding, time/text/image embedding, the blocks and the head in one
go. The variants of the reference add to it in between (DiffSynth-Studio's `model_fn_wan_video`):

* after the patch embedding, a residual on the patch grid: Fun-Control-Camera's control adapter output, Animate's
  pose embedding (`patch_residual`);
* tokens in front of the video tokens, one latent frame's worth, which RoPE sees as frame 0 and the head drops
  again: Fun-Control V1.1's reference image through `ref_conv` (`prefix_tokens`);
* on the block modulation (`timestep_proj`, not the head's): the speed-control motion controller
  (`timestep_proj_residual`);
* after given blocks, a residual computed from the block inputs: VACE's hints, Animate's face adapter
  (`block_hooks`).

With none of them the result is `dit(...)`'s exactly (the same operations in the same order).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass
class BlockInputs:
    """What every DiT block reads: the tokens entering block 0, the text (+ image) context, the (B, 6, D)
    modulation and the rotary embedding (cos, sin)."""

    hidden_states: torch.Tensor
    encoder_hidden_states: torch.Tensor
    timestep_proj: torch.Tensor
    rotary_emb: tuple[torch.Tensor, torch.Tensor]


# Called once before the blocks; returns what to do after block i: (i, hidden_states) -> hidden_states.
BlockHook = Callable[[BlockInputs], Callable[[int, torch.Tensor], torch.Tensor]]


def run_checkpointed(module, block, *args):
    """`block(*args)`, through `module`'s gradient-checkpointing function when it has one switched on."""
    if torch.is_grad_enabled() and getattr(module, "gradient_checkpointing", False):
        return module._gradient_checkpointing_func(block, *args)
    return block(*args)


def wan_dit_forward(dit, hidden_states: torch.Tensor, timestep: torch.Tensor, encoder_hidden_states: torch.Tensor,
                    encoder_hidden_states_image: torch.Tensor | None = None, *,
                    patch_residual: torch.Tensor | None = None, prefix_tokens: torch.Tensor | None = None,
                    timestep_proj_residual: torch.Tensor | None = None,
                    block_hooks: Sequence[BlockHook] = ()) -> torch.Tensor:
    """(B, C_in, F, H, W) latents (conditions already on channels), timestep (B,) or (B, tokens) -> (B, C_out, F,
    H, W). `patch_residual`: (B, D, F, H/2, W/2); `prefix_tokens`: (B, H/2 * W/2, D); `timestep_proj_residual`:
    (B, 6 * D)."""
    batch_size, _, num_frames, height, width = hidden_states.shape
    p_t, p_h, p_w = dit.config.patch_size
    frames, rows, cols = num_frames // p_t, height // p_h, width // p_w
    prefix = 0 if prefix_tokens is None else prefix_tokens.shape[1]
    if prefix and prefix != rows * cols:
        raise ValueError(f"prefix tokens must fill one latent frame ({rows * cols} tokens), got {prefix}")

    # RoPE over the frames the blocks see: the prefix frame first
    grid = hidden_states if not prefix else torch.empty(
        (batch_size, 1, num_frames + p_t, height, width), device="meta")
    rotary_emb = dit.rope(grid)

    hidden_states = dit.patch_embedding(hidden_states)
    if patch_residual is not None:
        hidden_states = hidden_states + patch_residual.to(hidden_states.dtype)
    hidden_states = hidden_states.flatten(2).transpose(1, 2)
    if prefix:
        hidden_states = torch.cat([prefix_tokens.to(hidden_states.dtype), hidden_states], dim=1)
    hidden_states = hidden_states.contiguous()

    if timestep.ndim == 2:  # per-token timesteps (TI2V-5B)
        ts_seq_len = timestep.shape[1]
        timestep = timestep.flatten()
    else:
        ts_seq_len = None
    temb, timestep_proj, encoder_hidden_states, encoder_hidden_states_image = dit.condition_embedder(
        timestep, encoder_hidden_states, encoder_hidden_states_image, timestep_seq_len=ts_seq_len)
    if timestep_proj_residual is not None:
        timestep_proj = timestep_proj + timestep_proj_residual.to(timestep_proj.dtype)
    timestep_proj = timestep_proj.unflatten(2 if ts_seq_len is not None else 1, (6, -1))
    if encoder_hidden_states_image is not None:
        encoder_hidden_states = torch.concat([encoder_hidden_states_image, encoder_hidden_states], dim=1)

    inputs = BlockInputs(hidden_states, encoder_hidden_states, timestep_proj, rotary_emb)
    after = [hook(inputs) for hook in block_hooks]
    for i, block in enumerate(dit.blocks):
        hidden_states = run_checkpointed(dit, block, hidden_states, encoder_hidden_states, timestep_proj,
                                         rotary_emb)
        for fn in after:
            hidden_states = fn(i, hidden_states)

    if prefix:
        hidden_states = hidden_states[:, prefix:]
    if temb.ndim == 3:
        shift, scale = (dit.scale_shift_table.unsqueeze(0).to(temb.device) + temb.unsqueeze(2)).chunk(2, dim=2)
        shift, scale = shift.squeeze(2), scale.squeeze(2)
    else:
        shift, scale = (dit.scale_shift_table.to(temb.device) + temb.unsqueeze(1)).chunk(2, dim=1)
    shift, scale = shift.to(hidden_states.device), scale.to(hidden_states.device)
    hidden_states = (dit.norm_out(hidden_states.float()) * (1 + scale) + shift).type_as(hidden_states)
    hidden_states = dit.proj_out(hidden_states)
    hidden_states = hidden_states.reshape(batch_size, frames, rows, cols, p_t, p_h, p_w, -1)
    hidden_states = hidden_states.permute(0, 7, 1, 4, 2, 5, 3, 6)
    return hidden_states.flatten(6, 7).flatten(4, 5).flatten(2, 3)


__all__ = ["BlockHook", "BlockInputs", "run_checkpointed", "wan_dit_forward"]
