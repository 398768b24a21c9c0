"""FLUX.1's denoiser call with the variants' inputs (the main line's model_fn takes this over once the features are
wired): one call of diffusers' `FluxTransformer2DModel` on packed 2x2 patches, plus

* `fill_condition` (Fill): concatenated to the noisy latents before packing (the Fill DiT's 384 inputs);
* `controlnet_conditioning` / `controlnet_mode` / `controlnet_scale` (ControlNets, `controlnet.py`): the ControlNet
  runs on the DiT's inputs and its residuals go in through `controlnet_block_samples`;
* `infinityou_face_embeds` / `infinityou_guidance` (InfiniteYou): the projector's tokens replace the prompt for the
  InfuseNet ControlNet, whose guidance is `infinityou_guidance`;
* `ipadapter_image_embeds` / `ipadapter_scale` (IP-Adapter): the adapter's per-block keys/values, attended in the
  DiT's attention (`attention.py`);
* `entity_prompt_embeds` / `entity_masks` (EliGen): entity prompts before the prompt and the regional mask.

A missing pooled prompt embedding (Redux) is zeros of the DiT's width, as the reference's Redux unit gives.
"""

from __future__ import annotations

from typing import Any

import torch

from ...core.checkpointing import set_gradient_checkpointing
from ...core.latents import pack_latents, unpack_latents
from ...errors import UserError
from .attention import use_feature_attention
from .controlnet import controlnet_samples, pad_samples
from .eligen import eligen_text_and_mask
from .model_fn import SAMPLING_GUIDANCE, image_ids


def _guidance(model, guidance, b, device):
    if not model.config.guidance_embeds:
        return None
    g = torch.full((b,), SAMPLING_GUIDANCE) if guidance is None else torch.as_tensor(guidance).reshape(-1)
    return g.to(device=device, dtype=torch.float32).expand(b)


def model_fn_flux_features(dit, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor,
                           pooled_prompt_embeds: torch.Tensor | None = None, guidance: torch.Tensor | None = None,
                           kontext_latents=None, kontext_ids=None, fill_condition=None,
                           controlnet=None, controlnet_conditioning=None, controlnet_mode=None,
                           controlnet_scale: float | None = None,
                           image_proj_model=None, infinityou_face_embeds=None, infinityou_guidance=None,
                           ipadapter=None, ipadapter_image_embeds=None, ipadapter_scale: float | None = None,
                           entity_prompt_embeds=None, entity_masks=None,
                           use_gradient_checkpointing: bool = False, use_gradient_checkpointing_offload: bool = False,
                           **_: Any) -> torch.Tensor:
    """latents (B, 16, h, w), timestep (B,) in [0, 1000] -> velocity (B, 16, h, w)."""
    b, _, h, w = latents.shape
    dtype, device = latents.dtype, latents.device
    noisy = pack_latents(latents)
    image_len = noisy.shape[1]
    tokens = noisy if fill_condition is None else \
        pack_latents(torch.cat([latents, fill_condition.to(device, dtype).expand(b, -1, -1, -1)], dim=1))
    if tokens.shape[-1] != dit.x_embedder.in_features:
        raise UserError(f"the DiT takes {dit.x_embedder.in_features} inputs per token, it was given {tokens.shape[-1]}"
                        + (": a FLUX.1 Fill DiT needs flux_fill_image and flux_fill_mask" if fill_condition is None
                           else ": fill_condition is only for a FLUX.1 Fill DiT"))
    set_gradient_checkpointing(dit, use_gradient_checkpointing, use_gradient_checkpointing_offload)
    t = timestep.to(device=device, dtype=dtype).expand(b) / 1000
    if pooled_prompt_embeds is None:
        pooled_prompt_embeds = torch.zeros(b, dit.config.pooled_projection_dim, device=device, dtype=dtype)
    pooled = pooled_prompt_embeds.to(device, dtype)
    text = prompt_embeds.to(device, dtype)
    img_ids = image_ids(h // 2, w // 2, device, dtype)
    txt_ids = torch.zeros(text.shape[1], 3, device=device, dtype=dtype)

    samples = single = None
    if controlnet is not None and controlnet_conditioning is not None:
        set_gradient_checkpointing(controlnet, use_gradient_checkpointing, use_gradient_checkpointing_offload)
        c_text, c_txt_ids, c_guidance = text, txt_ids, guidance
        if infinityou_face_embeds is not None:  # InfiniteYou: the InfuseNet reads the face tokens as its prompt
            if image_proj_model is None:
                raise UserError("InfiniteYou needs its image_proj_model (infu_flux_v1.0/.../image_proj_model.bin)")
            weight = image_proj_model.proj_in.weight
            c_text = image_proj_model(infinityou_face_embeds.to(weight.device, weight.dtype)).to(dtype)
            c_txt_ids = torch.zeros(c_text.shape[1], 3, device=device, dtype=dtype)
            c_guidance = 1.0 if infinityou_guidance is None else infinityou_guidance
        samples, single = controlnet_samples(
            controlnet, noisy, t, c_text, pooled, _guidance(controlnet, c_guidance, b, device), c_txt_ids, img_ids,
            controlnet_conditioning, controlnet_mode, 1.0 if controlnet_scale is None else float(controlnet_scale))
    elif infinityou_face_embeds is not None:
        raise UserError("InfiniteYou needs its InfuseNet ControlNet and a controlnet_image")

    attention_kwargs: dict[str, Any] = {}
    if ipadapter is not None and ipadapter_image_embeds is not None:
        attention_kwargs["ip_kv"] = ipadapter(ipadapter_image_embeds.to(device))
        attention_kwargs["ip_scale"] = 1.0 if ipadapter_scale is None else float(ipadapter_scale)
    if entity_prompt_embeds is not None and entity_masks is not None:
        if kontext_latents is not None:
            raise UserError("EliGen does not combine with kontext_images")
        text, attention_kwargs["attention_mask"] = eligen_text_and_mask(text, entity_prompt_embeds, entity_masks,
                                                                       image_len)
        txt_ids = torch.zeros(text.shape[1], 3, device=device, dtype=dtype)
    if attention_kwargs:
        use_feature_attention(dit)

    extra = 0
    if kontext_latents is not None:
        ids = kontext_ids.to(device=device, dtype=dtype)
        if ids.dim() == 3:
            if not bool((ids == ids[:1]).all()):
                raise UserError("kontext_images of different sizes in one batch (--batch_size 1 avoids it)")
            ids = ids[0]
        extra = kontext_latents.shape[1]
        tokens = torch.cat([tokens, kontext_latents.to(device=device, dtype=dtype).expand(b, -1, -1)], dim=1)
        img_ids = torch.cat([img_ids, ids], dim=0)
    out = dit(hidden_states=tokens, timestep=t, guidance=_guidance(dit, guidance, b, device),
              pooled_projections=pooled, encoder_hidden_states=text, txt_ids=txt_ids, img_ids=img_ids,
              joint_attention_kwargs=attention_kwargs or None,
              controlnet_block_samples=pad_samples(samples, extra),
              controlnet_single_block_samples=pad_samples(single, extra), return_dict=False)[0]
    return unpack_latents(out[:, :image_len], h, w)


__all__ = ["model_fn_flux_features"]
