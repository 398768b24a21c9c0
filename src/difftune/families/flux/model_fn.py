"""FLUX.1's model_fn: one call of diffusers' `FluxTransformer2DModel` on packed 2x2 latent patches, with what each
feature adds (as the reference's `model_fn_flux_image`):

* Kontext / Step1X reference latents (`kontext_latents`, `kontext_ids`): tokens after the noisy image's, cut from
  the output;
* Fill (`fill_condition`) and FLEX.2 (`flex_condition`, `flex_uncondition`, `flex_control_stop`): channels
  concatenated to the noisy latents before packing (a Fill / FLEX.2 DiT without them gets the reference's "nothing
  given" condition: zeros and an all-ones mask);
* a ControlNet (`controlnet_conditioning`, `controlnet_mode`, `controlnet_scale`; controlnet.py) run on the DiT's
  inputs, its residuals added after each block (diffusers' `controlnet_block_samples`); InfiniteYou
  (`infinityou_face_embeds`, `infinityou_guidance`): the projector's face tokens stand in for the prompt of the
  InfuseNet ControlNet;
* the IP-Adapter (`ipadapter_image_embeds`, `ipadapter_scale`) and EliGen (`entity_prompt_embeds`, `entity_masks`)
  through attention.py's processor;
* AttriCtrl / LoRA-Encoder tokens (`value_embeds`, `lora_encoder_embeds`) after the prompt tokens, text ids 0;
* Nexus-Gen's text position ids (`txt_ids`).

A missing pooled prompt embedding (Redux, Nexus-Gen without CLIP) is zeros of the DiT's width, as the reference's
Redux unit gives.
"""

from __future__ import annotations

from typing import Any

import torch

from ...core.checkpointing import set_gradient_checkpointing
from ...core.latents import pack_latents, unpack_latents
from ...errors import UserError

FILL_IN_CHANNELS = 384  # 4 x (16 noisy + 16 masked-image latents + 64 folded mask channels)
FLEX_IN_CHANNELS = 196  # 4 x (16 noisy + 16 inpaint latents + 1 mask + 16 control latents)


def image_ids(h: int, w: int, device, dtype) -> torch.Tensor:
    """(h*w, 3) position ids of the packed tokens: (0, row, column), row-major (diffusers' layout)."""
    rows = torch.arange(h, device=device).view(h, 1).expand(h, w)
    cols = torch.arange(w, device=device).view(1, w).expand(h, w)
    ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(h * w, 3)
    return ids.to(dtype)


def _guidance(model, guidance, b: int, device, default: float):
    if not model.config.guidance_embeds:
        return None
    g = torch.full((b,), default) if guidance is None else torch.as_tensor(guidance).reshape(-1)
    return g.to(device=device, dtype=torch.float32).expand(b)


def _one_set(ids: torch.Tensor, what: str) -> torch.Tensor:
    """Position ids given per sample (B, n, 3): the transformer takes one set for the batch."""
    if ids.dim() == 3:
        if not bool((ids == ids[:1]).all()):
            raise UserError(f"{what} of different sizes in one batch (--batch_size 1 avoids it)")
        ids = ids[0]
    return ids


def default_condition(in_channels: int, b: int, h: int, w: int, device, dtype) -> torch.Tensor | None:
    """The condition channels a Fill / FLEX.2 DiT reads when none are given (the reference's units without their
    images): Fill: zero image latents, all-ones folded mask; FLEX.2: zero inpaint latents, mask ones, zero control."""
    if in_channels == FILL_IN_CHANNELS:
        return torch.cat([torch.zeros(b, 16, h, w), torch.ones(b, 64, h, w)], 1).to(device, dtype)
    if in_channels == FLEX_IN_CHANNELS:
        return torch.cat([torch.zeros(b, 16, h, w), torch.ones(b, 1, h, w), torch.zeros(b, 16, h, w)], 1).to(
            device, dtype)
    return None


def _extra_channels(dit, latents, fill_condition, flex_condition, flex_uncondition, flex_stop_t, timestep):
    b, _, h, w = latents.shape
    want = dit.x_embedder.in_features // 4  # latent channels per pixel the DiT reads (2x2 patches)
    from .flex2 import flex_latents

    condition = fill_condition
    if condition is None and flex_condition is None and want != latents.shape[1]:
        condition = default_condition(dit.x_embedder.in_features, b, h, w, latents.device, latents.dtype)
    if condition is not None:
        latents = torch.cat([latents, condition.to(latents.device, latents.dtype).expand(b, -1, -1, -1)], dim=1)
    else:
        latents = flex_latents(latents, timestep, flex_condition, flex_uncondition, flex_stop_t)
    if latents.shape[1] != want:
        kind = "flux_fill_image / flux_fill_mask are for a FLUX.1 Fill DiT" if fill_condition is not None else \
            "the FLEX.2 condition is for a FLEX.2 DiT" if flex_condition is not None else "this is not a FLUX.1 DiT"
        raise UserError(f"the DiT takes {want * 4} inputs per token, it was given {latents.shape[1] * 4}: {kind}")
    return latents


def model_fn_flux(dit, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor,
                  pooled_prompt_embeds: torch.Tensor | None = None, guidance: torch.Tensor | None = None,
                  kontext_latents: torch.Tensor | None = None, kontext_ids: torch.Tensor | None = None,
                  use_gradient_checkpointing: bool = False, use_gradient_checkpointing_offload: bool = False,
                  default_guidance: float = 3.5, *, fill_condition=None, controlnet=None,
                  controlnet_conditioning=None, controlnet_mode=None, controlnet_scale=None, image_proj_model=None,
                  infinityou_face_embeds=None, infinityou_guidance=None, ipadapter=None, ipadapter_image_embeds=None,
                  ipadapter_scale=None, entity_prompt_embeds=None, entity_masks=None, flex_condition=None,
                  flex_uncondition=None, flex_stop_t: float | None = None, value_embeds=None,
                  lora_encoder_embeds=None, txt_ids=None, **_: Any) -> torch.Tensor:
    """One denoiser call: latents (B, 16, h, w), timestep (B,) in [0, 1000] -> velocity (B, 16, h, w).

    Tokens after the noisy image's (Kontext, Step1X references) are cut from the output, so a loss sees only the
    image's. `default_guidance`: the embedded guidance where the values have none (the sampling default)."""
    from .attention import use_feature_attention
    from .controlnet import controlnet_samples, pad_samples
    from .eligen import eligen_text_and_mask
    from .value_control import extend_prompt

    b, _, h, w = latents.shape
    dtype, device = latents.dtype, latents.device
    noisy = pack_latents(latents)
    image_len = noisy.shape[1]
    t = timestep.to(device=device, dtype=dtype).expand(b) / 1000
    tokens = pack_latents(_extra_channels(dit, latents, fill_condition, flex_condition, flex_uncondition, flex_stop_t,
                                          timestep))
    set_gradient_checkpointing(dit, use_gradient_checkpointing, use_gradient_checkpointing_offload)
    if pooled_prompt_embeds is None:
        pooled_prompt_embeds = torch.zeros(b, dit.config.pooled_projection_dim)
    pooled = pooled_prompt_embeds.to(device, dtype)
    text = extend_prompt(prompt_embeds.to(device, dtype), value_embeds, lora_encoder_embeds)
    if txt_ids is None:
        text_ids = torch.zeros(text.shape[1], 3, device=device, dtype=dtype)
    else:  # Nexus-Gen's tokens sit on the latent grid; tokens appended after them get ids 0
        text_ids = _one_set(txt_ids.to(device=device, dtype=dtype), "nexus_gen_reference_image")
        text_ids = torch.cat([text_ids, text_ids.new_zeros(text.shape[1] - text_ids.shape[0], 3)])
    img_ids = image_ids(h // 2, w // 2, device, dtype)

    samples = single = None
    if controlnet_conditioning is not None:
        if controlnet is None:
            raise UserError("a controlnet_image is given but no ControlNet is loaded: add its weights (e.g. "
                            "InstantX/FLUX.1-dev-Controlnet-Union-alpha:diffusion_pytorch_model.safetensors)")
        set_gradient_checkpointing(controlnet, use_gradient_checkpointing, use_gradient_checkpointing_offload)
        c_text, c_ids, c_guidance = text, text_ids, guidance
        if infinityou_face_embeds is not None:  # InfiniteYou: the InfuseNet reads the face tokens as its prompt
            if image_proj_model is None:
                raise UserError("InfiniteYou needs its image_proj_model (ByteDance/InfiniteYou:infu_flux_v1.0/"
                                "aes_stage2/image_proj_model.bin)")
            weight = image_proj_model.proj_in.weight
            c_text = image_proj_model(infinityou_face_embeds.to(weight.device, weight.dtype)).to(dtype)
            c_ids = torch.zeros(c_text.shape[1], 3, device=device, dtype=dtype)
            c_guidance = 1.0 if infinityou_guidance is None else infinityou_guidance
        net = getattr(controlnet, "net", controlnet)  # the slot's wrapper, or a ControlNet itself
        samples, single = controlnet_samples(
            net, noisy, t, c_text, pooled, _guidance(net, c_guidance, b, device, default_guidance),
            c_ids, img_ids, controlnet_conditioning, controlnet_mode,
            1.0 if controlnet_scale is None else float(controlnet_scale))
    elif infinityou_face_embeds is not None:
        raise UserError("InfiniteYou needs its InfuseNet ControlNet and a controlnet_image")

    attention_kwargs: dict[str, Any] = {}
    if ipadapter_image_embeds is not None:
        if ipadapter is None:
            raise UserError("ipadapter_images are given but no IP-Adapter is loaded: add its weights "
                            "(InstantX/FLUX.1-dev-IP-Adapter:ip-adapter.bin)")
        attention_kwargs["ip_kv"] = ipadapter(ipadapter_image_embeds.to(device))
        attention_kwargs["ip_scale"] = 1.0 if ipadapter_scale is None else float(ipadapter_scale)
    if entity_prompt_embeds is not None and entity_masks is not None:
        if kontext_latents is not None:
            raise UserError("EliGen does not combine with kontext_images")
        text, attention_kwargs["attention_mask"] = eligen_text_and_mask(text, entity_prompt_embeds, entity_masks,
                                                                       image_len)
        text_ids = torch.cat([text_ids.new_zeros(text.shape[1] - text_ids.shape[0], 3), text_ids])
    if attention_kwargs:
        use_feature_attention(dit)

    after = 0
    if kontext_latents is not None:
        after = kontext_latents.shape[1]
        tokens = torch.cat([tokens, kontext_latents.to(device=device, dtype=dtype).expand(b, -1, -1)], dim=1)
        img_ids = torch.cat([img_ids, _one_set(kontext_ids.to(device=device, dtype=dtype), "kontext_images")], dim=0)
    out = dit(hidden_states=tokens, timestep=t, guidance=_guidance(dit, guidance, b, device, default_guidance),
              pooled_projections=pooled, encoder_hidden_states=text, txt_ids=text_ids, img_ids=img_ids,
              joint_attention_kwargs=attention_kwargs or None,
              controlnet_block_samples=pad_samples(samples, after),
              controlnet_single_block_samples=pad_samples(single, after), return_dict=False)[0]
    return unpack_latents(out[:, :image_len], h, w)


__all__ = ["FILL_IN_CHANNELS", "FLEX_IN_CHANNELS", "default_condition", "image_ids", "model_fn_flux"]
