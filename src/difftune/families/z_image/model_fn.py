"""Z-Image's model_fn: one call of diffusers' `ZImageTransformer2DModel` (Z-Image, Turbo, Omni-Base), or the DiT
with a Fun ControlNet (controlnet.py).

The DiT reads one latent per sample as (C, 1, H, W) and the prompt as its real tokens; it predicts x0 - noise at
t = 1 - sigma, so the velocity the losses and the sampler use is its negation (as diffusers' pipelines).
"""

from __future__ import annotations

from typing import Any

import torch

from ...core.checkpointing import set_gradient_checkpointing
from ...errors import UserError
from .controlnet import controlled_forward


def is_omni(dit) -> bool:
    """Omni-Base's DiT has a SigLIP embedder (its config's siglip_feat_dim)."""
    return getattr(dit, "siglip_embedder", None) is not None


def prompt_rows(prompt_embeds: torch.Tensor, prompt_embeds_mask: torch.Tensor | None) -> list[torch.Tensor]:
    """Per sample: its real tokens (l, D) of the padded (B, L, D) prompt."""
    if prompt_embeds_mask is None:
        return list(prompt_embeds)
    return [e[m.bool()] for e, m in zip(prompt_embeds, prompt_embeds_mask)]


def omni_inputs(latents: list, caps: list, edit_latents, siglip_embeds, edit_text_embeds, dtype):
    """Omni mode's lists per sample: the edit images' clean latents then the target's; the prompt's pieces (the
    fixed ones around the images' slots, the prompt's own before the last); SigLIP features with an empty slot for
    the target (diffusers' layout); which images are noisy."""
    x, texts, siglip, noisy = [], [], [], []
    for i, (target, prompt) in enumerate(zip(latents, caps)):
        edits = list(edit_latents[i]) if edit_latents is not None and edit_latents[i] is not None else []
        if edits and (edit_text_embeds is None or siglip_embeds is None):
            raise UserError("Omni-Base edit images need their text pieces and SigLIP features (the edit feature's "
                            "units): run the pipeline's units on the edit images")
        x.append([e.to(dtype).unsqueeze(1) for e in edits] + [target])
        if edits:
            fixed = [f.to(dtype) for f in edit_text_embeds[i]]
            texts.append(fixed[:-1] + [prompt] + fixed[-1:])
            siglip.append([s.to(dtype) for s in siglip_embeds[i]] + [None])
        else:
            texts.append([prompt])
            siglip.append(None)
        noisy.append([0] * len(edits) + [1])
    return x, texts, siglip, noisy


def model_fn_z_image(dit, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor,
                     prompt_embeds_mask: torch.Tensor | None = None, edit_latents=None, siglip_embeds=None,
                     edit_text_embeds=None, controlnet=None, control_context=None, control_scale: float | None = None,
                     control_refiner_hints: bool = True, use_gradient_checkpointing: bool = False,
                     use_gradient_checkpointing_offload: bool = False, **_: Any) -> torch.Tensor:
    """latents (B, 16, h, w), timestep (B,) in [0, 1000] -> velocity (B, 16, h, w).

    Omni-Base (a DiT with a SigLIP embedder) always runs in its omni mode, the edit images' latents (clean) and
    SigLIP features before the target, as diffusers' `ZImageOmniPipeline`. `control_context` runs the Fun
    ControlNet."""
    b = latents.shape[0]
    dtype = next(dit.parameters()).dtype
    t = (1000 - timestep.to(device=latents.device, dtype=torch.float32).reshape(-1).expand(b)) / 1000
    x = list(latents.to(dtype).unsqueeze(2).unbind(0))
    caps = prompt_rows(prompt_embeds.to(dtype), prompt_embeds_mask)
    set_gradient_checkpointing(dit, use_gradient_checkpointing, use_gradient_checkpointing_offload)
    if is_omni(dit):
        if control_context is not None:
            raise UserError("the Fun ControlNet works with Z-Image(-Turbo)'s DiT, not Omni-Base's")
        x_in, caps_in, sig, noisy = omni_inputs(x, caps, edit_latents, siglip_embeds, edit_text_embeds, dtype)
        out = dit(x_in, t, caps_in, siglip_feats=sig, image_noise_mask=noisy, return_dict=False)[0]
    elif edit_latents is not None:
        raise UserError("edit images need Z-Image-Omni-Base's DiT (transformer/ of Tongyi-MAI/Z-Image-Omni-Base); "
                        "this DiT has no SigLIP embedder")
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
