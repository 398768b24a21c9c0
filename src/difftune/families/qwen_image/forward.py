"""The Qwen-Image transformer's forward pass, block by block, for what diffusers' `forward` has no opening for:
EliGen's text sequence (entity prompts, their RoPE positions and a full attention mask) and the Blockwise
ControlNet's residual after each block. It calls the transformer's own modules in the order
`QwenImageTransformer2DModel.forward` does (tests check it equals that forward when neither is used)."""

from __future__ import annotations

from collections.abc import Callable
from math import prod

import torch
from diffusers.models.transformers.transformer_qwenimage import compute_text_seq_len_from_mask

from ...core.checkpointing import gradient_checkpoint_forward


def transformer_forward(dit, tokens: torch.Tensor, timestep: torch.Tensor, text: torch.Tensor,
                        text_mask: torch.Tensor | None, img_shapes: list, *, attention_mask: torch.Tensor | None = None,
                        txt_freqs: torch.Tensor | None = None,
                        block_residual: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
                        use_gradient_checkpointing: bool = False, use_gradient_checkpointing_offload: bool = False,
                        additional_t_cond: torch.Tensor | None = None) -> torch.Tensor:
    """`dit(hidden_states=tokens, timestep=timestep, encoder_hidden_states=text, ...)`'s output, except that

    * `attention_mask` (B, 1, S, S) over [text, image] replaces the text padding mask (the masked processor
      of eligen.py must be installed);
    * `txt_freqs` (text length, head_dim / 2) replaces the text's RoPE frequencies;
    * `block_residual(i, image_tokens)` is added to the image stream after block i.
    """
    hidden = dit.img_in(tokens)
    timestep = timestep.to(hidden.dtype)
    modulate_index = None
    if dit.zero_cond_t:  # Edit-2511: condition tokens are modulated at t = 0
        timestep = torch.cat([timestep, timestep * 0], dim=0)
        modulate_index = torch.tensor([[0] * prod(s[0]) + [1] * sum(prod(x) for x in s[1:]) for s in img_shapes],
                                      device=timestep.device, dtype=torch.int)
    text = dit.txt_in(dit.txt_norm(text))
    text_len, _, text_mask = compute_text_seq_len_from_mask(text, text_mask)
    temb = dit.time_text_embed(timestep, hidden, additional_t_cond)
    img_freqs, default_txt = dit.pos_embed(img_shapes, max_txt_seq_len=text_len, device=hidden.device)
    rope = (img_freqs, default_txt if txt_freqs is None else txt_freqs)
    kwargs = {} if attention_mask is None else {"attention_mask": attention_mask}
    if attention_mask is not None:
        text_mask = None  # the full mask already says which text tokens are padding
    for i, block in enumerate(dit.transformer_blocks):
        text, hidden = gradient_checkpoint_forward(
            block, use_gradient_checkpointing, use_gradient_checkpointing_offload, hidden_states=hidden,
            encoder_hidden_states=text, encoder_hidden_states_mask=text_mask, temb=temb, image_rotary_emb=rope,
            joint_attention_kwargs=kwargs, modulate_index=modulate_index)
        if block_residual is not None:
            hidden = block_residual(i, hidden)
    if dit.zero_cond_t:
        temb = temb.chunk(2, dim=0)[0]
    return dit.proj_out(dit.norm_out(hidden, temb))
