"""FLUX.1's model_fn: one call of diffusers' `FluxTransformer2DModel` on packed 2x2 latent patches (as the reference's
`model_fn_flux_image`). The call is assembled in a `FluxCall`: the base inputs (the noisy latents, the prompt tokens,
the pooled vector, the embedded guidance), then each feature of the call adds its part at the forward's named points
(`Feature.denoise`, in the feature's own module):

* before the blocks: condition channels after the latents' (Fill, FLEX.2), tokens after the prompt's (AttriCtrl,
  LoRA-Encoder), the prompt tokens' position ids (Nexus-Gen), image tokens after the noisy image's, cut from the
  output (Kontext; Step1X's reference passes them itself), and steps on the assembled inputs (`before_blocks`);
* after each block: residuals (a ControlNet's, diffusers' `controlnet_block_samples`; InfiniteYou gives the
  InfuseNet its prompt);
* in the attention: joint attention arguments (the IP-Adapter's keys and values, EliGen's regional mask) through
  attention.py's processor.

A missing pooled prompt embedding (Redux, Nexus-Gen without CLIP) is zeros of the DiT's width, as the reference's
Redux unit gives. A Fill / FLEX.2 DiT given no condition channels gets the reference's "nothing given" condition.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
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


def one_set(ids: torch.Tensor, what: str) -> torch.Tensor:
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


@dataclass
class FluxCall:
    """One denoiser call being assembled. `values`: the call's inputs (model_fn inputs, and the models of the features
    by slot name where a caller gives them); `settings`: its run-time settings. The fields after `pooled` are the
    forward's hook points, which the features' `denoise` fill in."""

    pipe: Any
    dit: Any
    values: Mapping[str, Any]
    settings: Mapping[str, Any]
    latents: torch.Tensor  # (B, 16, h, w)
    timestep: torch.Tensor  # (B,) in [0, 1000]
    t: torch.Tensor  # (B,) in [0, 1] (diffusers' convention)
    noisy: torch.Tensor  # the packed noisy latents (B, image_len, 64)
    guidance: Any
    default_guidance: float
    pooled: torch.Tensor
    # -- before the blocks --------------------------------------------------------------------------------------
    channels: list = field(default_factory=list)  # condition channels after the latents' (B, C, h, w)
    channels_for: str = "this is not a FLUX.1 DiT"  # what they are for (the error when the DiT takes another width)
    text: torch.Tensor | None = None  # the prompt tokens; then, assembled, the DiT's text sequence
    text_after: list = field(default_factory=list)  # tokens after the prompt's, text ids 0
    text_ids: torch.Tensor | None = None  # the prompt tokens' ids (default zeros); then the assembled ids
    img_ids: torch.Tensor | None = None  # the noisy image's ids (0, row, column)
    tokens_after: torch.Tensor | None = None  # image tokens after the noisy image's (B, n, 64), cut from the output
    ids_after: torch.Tensor | None = None  # their ids (n, 3)
    before_blocks: list = field(default_factory=list)  # steps on the assembled inputs, in feature order
    control_prompt: tuple | None = None  # (tokens, ids, guidance) a ControlNet reads instead of the DiT's prompt
    # -- after each block ---------------------------------------------------------------------------------------
    block_samples: list | None = None
    single_block_samples: list | None = None
    # -- in the attention ---------------------------------------------------------------------------------------
    attention: dict = field(default_factory=dict)

    @property
    def device(self):
        return self.latents.device

    @property
    def dtype(self):
        return self.latents.dtype

    @property
    def batch(self) -> int:
        return self.latents.shape[0]

    @property
    def image_len(self) -> int:
        return self.noisy.shape[1]

    def model(self, slot: str):
        """A feature's model: the one the caller gave by slot name, else the pipeline's (None: not loaded)."""
        if self.values.get(slot) is not None:
            return self.values[slot]
        return None if self.pipe is None else self.pipe.models.get(slot)

    def checkpointing(self, module) -> None:
        """Switch `module` (a feature's model in this call) to the call's gradient-checkpointing setting."""
        set_gradient_checkpointing(module, bool(self.settings.get("use_gradient_checkpointing")),
                                   bool(self.settings.get("use_gradient_checkpointing_offload")))

    def embedded_guidance(self, model, guidance=None):
        """`model`'s embedded guidance input (B,), None for a model without a guidance embedder."""
        return _guidance(model, self.guidance if guidance is None else guidance, self.batch, self.device,
                         self.default_guidance)


def _with_channels(call: FluxCall) -> torch.Tensor:
    """The latents with the condition channels the DiT reads (its own "nothing given" ones when none are given)."""
    dit, latents = call.dit, call.latents
    b, _, h, w = latents.shape
    want = dit.x_embedder.in_features // 4  # latent channels per pixel the DiT reads (2x2 patches)
    channels = list(call.channels)
    if not channels and want != latents.shape[1]:
        default = default_condition(dit.x_embedder.in_features, b, h, w, latents.device, latents.dtype)
        channels = [] if default is None else [default]
    if channels:
        latents = torch.cat([latents, *(c.to(latents.device, latents.dtype).expand(b, -1, -1, -1) for c in channels)],
                            dim=1)
    if latents.shape[1] != want:
        raise UserError(f"the DiT takes {want * 4} inputs per token, it was given {latents.shape[1] * 4}: "
                        f"{call.channels_for}")
    return latents


def model_fn_flux(dit, latents: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor,
                  pooled_prompt_embeds: torch.Tensor | None = None, guidance: torch.Tensor | None = None, *,
                  use_gradient_checkpointing: bool = False, use_gradient_checkpointing_offload: bool = False,
                  default_guidance: float = 3.5, pipe=None, features=None, tokens_after: torch.Tensor | None = None,
                  ids_after: torch.Tensor | None = None, **inputs: Any) -> torch.Tensor:
    """One denoiser call: latents (B, 16, h, w), timestep (B,) in [0, 1000] -> velocity (B, 16, h, w).

    `inputs`: the features' model_fn inputs (and their models by slot name, else `pipe`'s); each of `features`
    (default: FluxImagePipeline's) whose inputs the call has adds its part. `tokens_after` (B, n, 64) with their
    `ids_after` (n, 3): image tokens after the noisy image's (Step1X's reference), cut from the output, so a loss
    sees only the image's. `default_guidance`: the embedded guidance where the values have none."""
    from .attention import use_feature_attention
    from .controlnet import pad_samples
    from .value_control import extend_prompt

    if features is None:  # a direct call: the family's pipeline's (through the registry: no import cycle)
        from ...core.family import get_family

        features = get_family("flux").pipeline.features
    b, _, h, w = latents.shape
    dtype, device = latents.dtype, latents.device
    settings = {"use_gradient_checkpointing": use_gradient_checkpointing,
                "use_gradient_checkpointing_offload": use_gradient_checkpointing_offload}
    if pooled_prompt_embeds is None:
        pooled_prompt_embeds = torch.zeros(b, dit.config.pooled_projection_dim)
    call = FluxCall(pipe, dit, inputs, settings, latents, timestep, timestep.to(device=device, dtype=dtype).expand(b)
                    / 1000, pack_latents(latents), guidance, default_guidance, pooled_prompt_embeds.to(device, dtype),
                    text=prompt_embeds.to(device, dtype), tokens_after=tokens_after, ids_after=ids_after)
    for feature in features:
        if feature.in_call(inputs):
            feature.denoise(pipe, call)
    tokens = pack_latents(_with_channels(call))
    call.checkpointing(dit)
    text = extend_prompt(call.text, *call.text_after)
    if call.text_ids is None:
        text_ids = torch.zeros(text.shape[1], 3, device=device, dtype=dtype)
    else:  # ids given for the prompt's tokens; tokens appended after them get ids 0
        text_ids = torch.cat([call.text_ids, call.text_ids.new_zeros(text.shape[1] - call.text_ids.shape[0], 3)])
    call.text, call.text_ids, call.img_ids = text, text_ids, image_ids(h // 2, w // 2, device, dtype)
    for step in call.before_blocks:
        step(call)
    if call.attention:
        use_feature_attention(dit)

    img_ids, after = call.img_ids, 0
    if call.tokens_after is not None:
        after = call.tokens_after.shape[1]
        tokens = torch.cat([tokens, call.tokens_after.to(device=device, dtype=dtype).expand(b, -1, -1)], dim=1)
        img_ids = torch.cat([img_ids, call.ids_after.to(device=device, dtype=dtype)], dim=0)
    out = dit(hidden_states=tokens, timestep=call.t, guidance=call.embedded_guidance(dit),
              pooled_projections=call.pooled, encoder_hidden_states=call.text, txt_ids=call.text_ids, img_ids=img_ids,
              joint_attention_kwargs=call.attention or None,
              controlnet_block_samples=pad_samples(call.block_samples, after),
              controlnet_single_block_samples=pad_samples(call.single_block_samples, after), return_dict=False)[0]
    return unpack_latents(out[:, :call.image_len], h, w)


__all__ = ["FILL_IN_CHANNELS", "FLEX_IN_CHANNELS", "FluxCall", "default_condition", "image_ids", "model_fn_flux",
           "one_set"]
