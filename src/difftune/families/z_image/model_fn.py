"""Z-Image's model_fn: one call of diffusers' `ZImageTransformer2DModel` (Z-Image, Turbo, Omni-Base), and the Fun
ControlNet's forward over the same modules.

The DiT reads one latent per sample as (C, 1, H, W) and the prompt as its real tokens; it predicts x0 - noise at
t = 1 - sigma, so the velocity the losses and the sampler use is its negation (as diffusers' pipelines).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.utils.rnn import pad_sequence

from ...core.checkpointing import gradient_checkpoint_forward, set_gradient_checkpointing
from ...errors import UserError

PATCH = "2-1"  # the only patch size (2) and frame patch size (1) Z-Image has


def prompt_list(prompt_embeds: torch.Tensor, prompt_embeds_mask: torch.Tensor | None,
                prompt_pieces: torch.Tensor | None = None) -> list:
    """Per sample: its real tokens (B, L, D) + mask -> [(l, D)], or with Omni pieces -> [[(l_j, D), ...]]."""
    rows = [e if prompt_embeds_mask is None else e[m.bool()] for e, m in
            zip(prompt_embeds, prompt_embeds_mask if prompt_embeds_mask is not None else [None] * len(prompt_embeds))]
    if prompt_pieces is None:
        return rows
    return [list(r.split([int(n) for n in lengths])) for r, lengths in zip(rows, prompt_pieces)]


def model_fn_z_image(dit, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor,
                     prompt_embeds_mask: torch.Tensor | None = None, prompt_pieces: torch.Tensor | None = None,
                     edit_latents=None, siglip_embeds=None, controlnet=None, control_context=None,
                     control_scale: float | None = None, control_refiner_hints: bool = True,
                     use_gradient_checkpointing: bool = False, use_gradient_checkpointing_offload: bool = False,
                     **_: Any) -> torch.Tensor:
    """latents (B, 16, h, w), timestep (B,) in [0, 1000] -> velocity (B, 16, h, w).

    Omni-Base (a DiT with a SigLIP embedder) always runs in its omni mode: the edit images' latents (clean) and
    SigLIP features come before the target, whose SigLIP slot is empty, as diffusers' `ZImageOmniPipeline`.
    `control_context` runs the Fun ControlNet (`controlled_forward`)."""
    b = latents.shape[0]
    dtype = next(dit.parameters()).dtype
    t = (1000 - timestep.to(device=latents.device, dtype=torch.float32).reshape(-1).expand(b)) / 1000
    x = list(latents.to(dtype).unsqueeze(2).unbind(0))
    omni = getattr(dit, "siglip_embedder", None) is not None
    caps = prompt_list(prompt_embeds.to(dtype), prompt_embeds_mask, prompt_pieces if omni else None)
    set_gradient_checkpointing(dit, use_gradient_checkpointing, use_gradient_checkpointing_offload)
    if omni:
        if control_context is not None:
            raise UserError("the Fun ControlNet works with Z-Image(-Turbo)'s DiT, not Omni-Base's")
        edits = [list(e) for e in edit_latents] if edit_latents is not None else [[] for _ in range(b)]
        x_in = [[e.to(dtype).unsqueeze(1) for e in edits[i]] + [x[i]] for i in range(b)]
        caps_in = [c if isinstance(c, list) else [c] for c in caps]
        sig = [None if not edits[i] else [s.to(dtype) for s in siglip_embeds[i]] + [None] for i in range(b)] \
            if siglip_embeds is not None else [None] * b
        noise_mask = [[0] * len(edits[i]) + [1] for i in range(b)]
        out = dit(x_in, t, caps_in, siglip_feats=sig, image_noise_mask=noise_mask, return_dict=False)[0]
    elif control_context is not None:
        if controlnet is None:
            raise UserError("controlnet_image given but no ControlNet loaded: add the Fun ControlNet's file to "
                            "--model_paths / --model_id_with_origin_paths")
        out = controlled_forward(dit, controlnet, x, t, caps, control_context.to(dtype),
                                 1.0 if control_scale is None else control_scale, control_refiner_hints,
                                 use_gradient_checkpointing, use_gradient_checkpointing_offload)
    else:
        out = dit(x, t, caps, return_dict=False)[0]
    return -torch.stack([o.float() for o in out]).squeeze(2).to(latents.dtype)


def controlled_forward(dit, controlnet, x_list: list, t: torch.Tensor, caps: list, control_context: torch.Tensor,
                       scale: float, refiner_hints: bool, ckpt: bool = False, offload: bool = False) -> list:
    """The DiT with a Fun ControlNet (2.1: Union, Tile and their 8-step variants), over diffusers' modules.

    The control context is embedded at the image tokens' positions; the control noise refiner (its first block
    fed the embedded image tokens) gives one hint per DiT refiner layer, added after that layer; the control
    blocks run on [control tokens, prompt tokens] beside the unified sequence and give one hint per control place,
    added after that DiT layer. `refiner_hints=False` leaves the refiner hints out of the DiT's own stream (they
    still shape the stream the control blocks see): diffusers' `ZImageControlNetPipeline`; the reference and
    VideoX-Fun add them (True)."""
    device = x_list[0].device

    def run(module, *args):
        return gradient_checkpoint_forward(module, ckpt, offload, *args)

    adaln = dit.t_embedder(t * dit.t_scale).type_as(x_list[0])
    x, cap, x_size, x_pos, cap_pos, x_pad, cap_pad = dit.patchify_and_embed(x_list, caps, 2, 1)
    x_lens = [len(i) for i in x]
    x = dit.all_x_embedder[PATCH](torch.cat(x, dim=0))
    x, x_freqs, x_mask, _, _ = dit._prepare_sequence(list(x.split(x_lens)), x_pos, x_pad, dit.x_pad_token, None,
                                                     device)
    c = controlnet.control_all_x_embedder[PATCH](torch.cat(controlnet.patchify(list(control_context), 2, 1)))
    c = torch.where(torch.cat(x_pad).unsqueeze(-1), dit.x_pad_token.to(c.dtype), c)
    c = pad_sequence(list(c.split(x_lens)), batch_first=True, padding_value=0.0)
    for layer in controlnet.control_noise_refiner:
        c = run(layer, c, x, x_mask, x_freqs, adaln)
    r_hints, c = torch.unbind(c)[:-1], torch.unbind(c)[-1]
    r_places = {p: i for i, p in enumerate(controlnet.config.control_refiner_layers_places)}
    hinted = plain = x
    for i, layer in enumerate(dit.noise_refiner):
        hinted = run(layer, hinted, x_mask, x_freqs, adaln)
        if i in r_places:
            hinted = hinted + r_hints[r_places[i]] * scale
        if not refiner_hints:
            plain = run(layer, plain, x_mask, x_freqs, adaln)
    cap_lens = [len(i) for i in cap]
    cap = dit.cap_embedder(torch.cat(cap, dim=0))
    cap, cap_freqs, cap_mask, _, _ = dit._prepare_sequence(list(cap.split(cap_lens)), cap_pos, cap_pad,
                                                           dit.cap_pad_token, None, device)
    for layer in dit.context_refiner:
        cap = run(layer, cap, cap_mask, cap_freqs)

    def unify(stream):
        return dit._build_unified_sequence(stream, x_freqs, x_lens, None, cap, cap_freqs, cap_lens, None, None, None,
                                           None, None, False, device)

    unified, freqs, mask, _ = unify(hinted)
    control = pad_sequence([torch.cat([c[i][:x_lens[i]], cap[i][:cap_lens[i]]]) for i in range(len(x_lens))],
                           batch_first=True, padding_value=0.0)
    for layer in controlnet.control_layers:
        control = run(layer, control, unified, mask, freqs, adaln)
    hints = {p: h * scale for p, h in zip(controlnet.config.control_layers_places, torch.unbind(control)[:-1])}
    if not refiner_hints:
        unified = unify(plain)[0]
    for i, layer in enumerate(dit.layers):
        unified = run(layer, unified, mask, freqs, adaln)
        if i in hints:
            unified = unified + hints[i]
    unified = dit.all_final_layer[PATCH](unified, c=adaln)
    return dit.unpatchify(list(unified.unbind(dim=0)), x_size, 2, 1)
