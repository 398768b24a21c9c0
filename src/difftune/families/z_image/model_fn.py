"""Z-Image's model_fn: one call of diffusers' `ZImageTransformer2DModel` (Z-Image, Turbo, Omni-Base), assembled in a
`ZImageCall` to which each feature of the call adds its part (edit.py: Omni-Base's edit images; controlnet.py: the
DiT's forward with a Fun ControlNet).

The DiT reads one latent per sample as (C, 1, H, W) and the prompt as its real tokens; it predicts x0 - noise at
t = 1 - sigma, so the velocity the losses and the sampler use is its negation (as diffusers' pipelines).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ...core.checkpointing import set_gradient_checkpointing
from ...errors import UserError
from .attention import use_joint_qk


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


@dataclass
class ZImageCall:
    """One denoiser call being assembled: per sample the target's latents `x` (C, 1, H, W) and the prompt's tokens
    `caps`; `t` the DiT's time; `omni`: the DiT is Omni-Base's (it always runs its omni forward)."""

    pipe: Any
    dit: Any
    values: Mapping[str, Any]
    x: list
    t: torch.Tensor
    caps: list
    dtype: torch.dtype
    omni: bool
    use_gradient_checkpointing: bool = False
    use_gradient_checkpointing_offload: bool = False
    # -- the forward's hook points -------------------------------------------------------------------------
    # omni mode: per sample the clean images' latents, their SigLIP features and the text pieces around their slots
    # (the edit images'), taken before the target as diffusers' `ZImageOmniPipeline`
    conditions: tuple = (None, None, None)
    # fn(call) -> the DiT's output list, in place of its plain forward (the Fun ControlNet's)
    forward: Callable | None = None


def model_fn_z_image(dit, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor,
                     prompt_embeds_mask: torch.Tensor | None = None, *, pipe=None, features=(),
                     use_gradient_checkpointing: bool = False, use_gradient_checkpointing_offload: bool = False,
                     **inputs: Any) -> torch.Tensor:
    """latents (B, 16, h, w), timestep (B,) in [0, 1000] -> velocity (B, 16, h, w).

    Omni-Base (a DiT with a SigLIP embedder) always runs in its omni mode. `features`: the pipeline's features; each
    one whose model_fn inputs are given adds its part (`Feature.denoise`): the edit images' conditions, the Fun
    ControlNet's forward. `inputs` also carries the call's settings (`control_scale`, ...)."""
    b = latents.shape[0]
    dtype = next(dit.parameters()).dtype
    t = (1000 - timestep.to(device=latents.device, dtype=torch.float32).reshape(-1).expand(b)) / 1000
    x = list(latents.to(dtype).unsqueeze(2).unbind(0))
    caps = prompt_rows(prompt_embeds.to(dtype), prompt_embeds_mask)
    set_gradient_checkpointing(dit, use_gradient_checkpointing, use_gradient_checkpointing_offload)
    use_joint_qk(dit)
    call = ZImageCall(pipe, dit, inputs, x, t, caps, dtype, is_omni(dit), use_gradient_checkpointing,
                      use_gradient_checkpointing_offload)
    for feature in features:
        if feature.in_call(inputs):
            feature.denoise(pipe, call)
    if call.omni:
        x_in, caps_in, sig, noisy = omni_inputs(x, caps, *call.conditions, dtype)
        out = dit(x_in, t, caps_in, siglip_feats=sig, image_noise_mask=noisy, return_dict=False)[0]
    elif call.forward is not None:
        out = call.forward(call)
    else:
        out = dit(x, t, caps, return_dict=False)[0]
    return -torch.stack([o.float() for o in out]).squeeze(2).to(latents.dtype)
