"""FLUX.1 ControlNets: InstantX's Union-alpha, jasperai's Upscaler, alimama's Inpainting-Beta and InfiniteYou's
InfuseNet (slot `controlnet`).

All four releases are diffusers `FluxControlNetModel` files (`diffusion_pytorch_model.safetensors` in diffusers'
names: `transformer_blocks.N.attn.to_q`, `controlnet_blocks.N`, `controlnet_x_embedder`, Union's
`controlnet_mode_embedder`), so they load onto diffusers' class with their own keys. Inpainting-Beta's
`controlnet_x_embedder` takes 4 more inputs per token (the inpaint mask, one per 2x2 patch position), which
diffusers' class has no option for: `FluxControlNetWithExtraCondition` adds it (`extra_condition_channels`). The
slot holds `FluxMultiControlNet`, the ControlNet at `models.0.` as in the reference's pipeline, so the reference's
`--remove_prefix_in_ckpt pipe.controlnet.models.0.` writes a trained ControlNet in the released (diffusers) names.

What runs where (as the reference's `FluxImageUnit_ControlNet` and `model_fn_flux_image`):
* `FluxControlNetEmbedder` (unit, VAE only): the control image is VAE-encoded (FLUX's shift and scale); with an
  inpaint mask its light pixels are first blacked out and a "keep" channel (1 - mask, at latent resolution) joins
  the latents. Union's mode (`controlnet_processor_id`: canny, tile, depth, blur, pose, gray, lq or its index)
  becomes `controlnet_mode`. A trainable ControlNet leaves this encode in stage 1: the cache holds latents.
* `controlnet_samples` (in model_fn): the ControlNet's forward on the DiT's own inputs returns the residuals
  diffusers' `FluxTransformer2DModel.forward` adds after each block (`controlnet_block_samples`,
  `controlnet_single_block_samples`; a shorter stack is spread over the blocks as both diffusers and the reference
  do).
"""

from __future__ import annotations

import re
from typing import Any

import torch
from diffusers import ConfigMixin, FluxControlNetModel, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.models.controlnets.controlnet import zero_module

from ...core.features import IMAGE, VALUE, Feature
from ...core.options import sample_input
from ...core.latents import pack_latents
from ...core.units import PipelineUnit
from ...errors import UserError
from ...media.image import as_image_list
from ...models.detect import ComponentSpec
from ...parts.controlnet import ControlNetInput, encode_control_images
from ...parts.flux_ae import vae_encode

# Union-alpha's control modes (the reference's mode_dict; the embedding has 10 rows, 7 are named)
UNION_MODES = {"canny": 0, "tile": 1, "depth": 2, "blur": 3, "pose": 4, "gray": 5, "lq": 6}
INPAINT_EXTRA_CHANNELS = 4  # the mask channel x a 2x2 patch


class FluxControlNetWithExtraCondition(FluxControlNetModel):
    """diffusers' FluxControlNetModel whose `controlnet_x_embedder` also reads `extra_condition_channels` inputs per
    token (alimama's Inpainting-Beta: the packed inpaint mask after the 64 latent channels)."""

    @register_to_config
    def __init__(self, patch_size: int = 1, in_channels: int = 64, num_layers: int = 19, num_single_layers: int = 38,
                 attention_head_dim: int = 128, num_attention_heads: int = 24, joint_attention_dim: int = 4096,
                 pooled_projection_dim: int = 768, guidance_embeds: bool = False,
                 axes_dims_rope: tuple[int, ...] = (16, 56, 56), num_mode: int | None = None,
                 conditioning_embedding_channels: int | None = None, extra_condition_channels: int = 0):
        super().__init__(patch_size, in_channels, num_layers, num_single_layers, attention_head_dim,
                         num_attention_heads, joint_attention_dim, pooled_projection_dim, guidance_embeds,
                         list(axes_dims_rope), num_mode, conditioning_embedding_channels)
        self.controlnet_x_embedder = zero_module(torch.nn.Linear(in_channels + extra_condition_channels,
                                                                 self.inner_dim))


_BASE = {"_class_name": "FluxMultiControlNet", "patch_size": 1, "in_channels": 64, "attention_head_dim": 128,
         "num_attention_heads": 24, "joint_attention_dim": 4096, "pooled_projection_dim": 768,
         "guidance_embeds": True, "axes_dims_rope": [16, 56, 56], "num_mode": None,
         "conditioning_embedding_channels": None}
# The releases' sizes, as the reference's model registry records them.
UNION_ALPHA_CONFIG = {**_BASE, "num_layers": 5, "num_single_layers": 10, "num_mode": 10}
UPSCALER_CONFIG = {**_BASE, "num_layers": 5, "num_single_layers": 0}
INFUSENET_CONFIG = {**_BASE, "num_layers": 4, "num_single_layers": 10}
INPAINTING_BETA_CONFIG = {**_BASE, "num_layers": 6, "num_single_layers": 0,
                          "extra_condition_channels": INPAINT_EXTRA_CHANNELS}


class FluxMultiControlNet(ModelMixin, ConfigMixin):
    """The `controlnet` slot: one FLUX ControlNet at `models.0` (the reference's pipeline keeps its ControlNets in a
    list there), so `--remove_prefix_in_ckpt pipe.controlnet.models.0.` saves a trained ControlNet in diffusers'
    names, which `FluxControlNetModel` loads. The config is the ControlNet's own (plus `extra_condition_channels`)."""

    _supports_gradient_checkpointing = True

    @register_to_config
    def __init__(self, patch_size: int = 1, in_channels: int = 64, num_layers: int = 19, num_single_layers: int = 38,
                 attention_head_dim: int = 128, num_attention_heads: int = 24, joint_attention_dim: int = 4096,
                 pooled_projection_dim: int = 768, guidance_embeds: bool = False,
                 axes_dims_rope: tuple[int, ...] = (16, 56, 56), num_mode: int | None = None,
                 conditioning_embedding_channels: int | None = None, extra_condition_channels: int = 0):
        super().__init__()
        args = (patch_size, in_channels, num_layers, num_single_layers, attention_head_dim, num_attention_heads,
                joint_attention_dim, pooled_projection_dim, guidance_embeds, list(axes_dims_rope), num_mode,
                conditioning_embedding_channels)
        net = FluxControlNetWithExtraCondition(*args, extra_condition_channels=extra_condition_channels) \
            if extra_condition_channels else FluxControlNetModel(*args)
        self.models = torch.nn.ModuleList([net])

    @property
    def net(self) -> FluxControlNetModel:
        return self.models[0]


def controlnet_key(key: str) -> str:
    """Released files (and diffusers' save_pretrained) hold one ControlNet's keys: the slot keeps it at `models.0.`
    (the reference's trained files, `pipe.controlnet.` removed, already say so)."""
    for prefix in ("pipe.controlnet.", "controlnet."):
        if key.startswith(prefix):
            key = key[len(prefix):]
    return key if key.startswith("models.") else "models.0." + key


_DOUBLE = re.compile(r"^models\.0\.transformer_blocks\.(\d+)\.")
_SINGLE = re.compile(r"^models\.0\.single_transformer_blocks\.(\d+)\.")
FLUX_ROPE_AXES = {128: [16, 56, 56]}  # head dim -> FLUX.1's RoPE axes (not in the weights)


def _rope_axes(head_dim: int) -> list[int] | None:
    """FLUX.1's RoPE split (16, 56, 56 of 128); at another head size its proportions 1/8, 7/16, 7/16."""
    if head_dim in FLUX_ROPE_AXES:
        return FLUX_ROPE_AXES[head_dim]
    return [head_dim // 8, head_dim * 7 // 16, head_dim * 7 // 16] if head_dim % 32 == 0 else None


def controlnet_config_from_weights(shapes: dict[str, tuple[int, ...]]) -> dict | None:
    """A FLUX ControlNet's config read off its weights (any depth; keys at `models.0.`); None when not one. The
    RoPE axes are not in the weights: FLUX.1's split of the head (`_rope_axes`)."""
    def get(key):
        return shapes.get("models.0." + key)

    x, cx, q = get("x_embedder.weight"), get("controlnet_x_embedder.weight"), \
        get("transformer_blocks.0.attn.norm_q.weight")
    if x is None or cx is None or q is None or _rope_axes(q[0]) is None:
        return None
    inner, head_dim = x[0], q[0]
    config = {**_BASE, "in_channels": x[1], "attention_head_dim": head_dim, "num_attention_heads": inner // head_dim,
              "joint_attention_dim": get("context_embedder.weight")[1],
              "pooled_projection_dim": get("time_text_embed.text_embedder.linear_1.weight")[1],
              "guidance_embeds": get("time_text_embed.guidance_embedder.linear_1.weight") is not None,
              "axes_dims_rope": _rope_axes(head_dim),
              "num_layers": 1 + max((int(m[1]) for k in shapes if (m := _DOUBLE.match(k))), default=-1),
              "num_single_layers": 1 + max((int(m[1]) for k in shapes if (m := _SINGLE.match(k))), default=-1),
              "num_mode": get("controlnet_mode_embedder.weight")[0] if get("controlnet_mode_embedder.weight")
              else None}
    extra = cx[1] - x[1]
    return {**config, "extra_condition_channels": extra} if extra else config


_MARKERS = ("models.0.controlnet_x_embedder.weight", "models.0.controlnet_blocks.0.weight",
            "models.0.transformer_blocks.0.attn.to_q.weight")

CONTROLNET = ComponentSpec(
    name="controlnet", library=__name__, class_name="FluxMultiControlNet",
    known_configs={"InstantX/FLUX.1-dev-Controlnet-Union-alpha": UNION_ALPHA_CONFIG,
                   "jasperai/Flux.1-dev-Controlnet-Upscaler": UPSCALER_CONFIG,
                   "ByteDance/InfiniteYou InfuseNet (infu_flux_v1.0)": INFUSENET_CONFIG,
                   "alimama-creative/FLUX.1-dev-Controlnet-Inpainting-Beta": INPAINTING_BETA_CONFIG},
    marker_keys=_MARKERS, normalize_key=controlnet_key, infer_config=controlnet_config_from_weights,
    # the releases' config.json names diffusers' class (the inpainting one's mask channels do not show in it):
    # the weights say everything
    foreign_config_classes=("FluxControlNetModel",),
    description="FLUX.1 ControlNet (diffusers FluxControlNetModel; with an inpaint mask's channels for alimama's)")


def controlnet_native_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The slot's state dict as a released ControlNet file (diffusers' names, `models.0.` dropped)."""
    return {k[len("models.0."):] if k.startswith("models.0.") else k: v for k, v in state.items()}


# -- the unit -------------------------------------------------------------------------------------------------

def control_mode(processor_id, num_mode: int | None = None) -> int:
    """Union's mode index from `controlnet_processor_id` (a name of UNION_MODES or an index)."""
    if isinstance(processor_id, str) and processor_id.strip().lower() in UNION_MODES:
        return UNION_MODES[processor_id.strip().lower()]
    try:
        index = int(str(processor_id).strip())
    except ValueError:
        raise UserError(f"controlnet_processor_id: {processor_id!r} is not a Union ControlNet mode "
                        f"({', '.join(UNION_MODES)} or an index)") from None
    if index < 0 or (num_mode is not None and index >= num_mode):
        raise UserError(f"controlnet_processor_id: mode {index} is out of range (0..{(num_mode or 10) - 1})")
    return index


def _per_sample(value, n: int, name: str) -> list:
    if value is None:
        return [None] * n
    items = value if isinstance(value, (list, tuple)) else [value]
    if len(items) == 1:
        return list(items) * n
    if len(items) != n:
        raise UserError(f"{name}: {len(items)} values for {n} sample(s)")
    return list(items)


class FluxControlNetEmbedder(PipelineUnit):
    """The control image (and inpaint mask) -> `controlnet_conditioning` (B, 16 [+1 keep channel], H/8, W/8) VAE
    latents; `controlnet_processor_id` -> `controlnet_mode` (B,) for Union-alpha. Uses the VAE only: the ControlNet
    itself runs in model_fn."""

    feature = "controlnet"
    before = ("FluxClipEmbedder",)
    inputs = ("controlnet_image", "controlnet_inpaint_mask", "controlnet_processor_id", "controlnet_scale", "height",
              "width", "batch_size")
    outputs = ("controlnet_conditioning", "controlnet_mode", "controlnet_scale")
    models = ("vae",)
    batching = {"controlnet_scale": "same"}

    def process(self, pipe, controlnet_image, controlnet_inpaint_mask, controlnet_processor_id, controlnet_scale,
                height, width, batch_size):
        if controlnet_image is None:
            if controlnet_inpaint_mask is not None or controlnet_processor_id is not None:
                raise UserError("controlnet_inpaint_mask / controlnet_processor_id are given without controlnet_image")
            return {}
        images = as_image_list(controlnet_image)
        n = max(int(batch_size or 1), len(images))
        masks = _per_sample(controlnet_inpaint_mask, len(images), "controlnet_inpaint_mask")
        out = encode_control_images(pipe, images, masks, height, width, vae_encode)
        if len({t.shape for t in out}) > 1:
            raise UserError("controlnet_inpaint_mask: give every sample of a batch a mask, or none")
        conditioning = torch.cat(out)
        if conditioning.shape[0] == 1 and n > 1:
            conditioning = conditioning.expand(n, -1, -1, -1)
        result = {"controlnet_conditioning": conditioning.to(pipe.torch_dtype).contiguous(),
                  "controlnet_scale": None if controlnet_scale is None else float(controlnet_scale)}
        if controlnet_processor_id is not None:
            modes = [control_mode(p) for p in _per_sample(controlnet_processor_id, n, "controlnet_processor_id")]
            result["controlnet_mode"] = torch.tensor(modes, dtype=torch.long, device=pipe.device)
        return result


# -- model_fn's part ------------------------------------------------------------------------------------------

def controlnet_samples(controlnet, tokens: torch.Tensor, timestep: torch.Tensor, prompt_embeds: torch.Tensor,
                       pooled_prompt_embeds: torch.Tensor, guidance: torch.Tensor | None, txt_ids: torch.Tensor,
                       img_ids: torch.Tensor, controlnet_conditioning: torch.Tensor,
                       controlnet_mode: torch.Tensor | None = None, controlnet_scale: float = 1.0):
    """The ControlNet's residuals for the DiT: (block samples, single block samples), each a list or None.

    `tokens` (B, n, 64) are the DiT's packed noisy latents, `timestep` (B,) in [0, 1] (diffusers' convention),
    `guidance` (B,) or None; `controlnet_conditioning` (B, C, h, w) the unit's latents, packed here."""
    cond = pack_latents(controlnet_conditioning.to(tokens.device, tokens.dtype))
    want = controlnet.controlnet_x_embedder.in_features
    if cond.shape[-1] != want:
        raise UserError(f"this ControlNet takes {want} conditioning channels per token, the control image gives "
                        f"{cond.shape[-1]}: give controlnet_inpaint_mask exactly when the ControlNet is an "
                        f"inpainting one (alimama's Inpainting-Beta)")
    mode = None
    if getattr(controlnet, "union", False):
        if controlnet_mode is None:
            raise UserError("a Union ControlNet needs controlnet_processor_id (the control mode: "
                            f"{', '.join(UNION_MODES)})")
        mode = torch.as_tensor(controlnet_mode, device=tokens.device).long().reshape(-1, 1).expand(tokens.shape[0], 1)
    if not controlnet.config.guidance_embeds:
        guidance = None
    samples, single = controlnet(hidden_states=tokens, controlnet_cond=cond, controlnet_mode=mode,
                                 conditioning_scale=controlnet_scale, encoder_hidden_states=prompt_embeds,
                                 pooled_projections=pooled_prompt_embeds, timestep=timestep, img_ids=img_ids,
                                 txt_ids=txt_ids, guidance=guidance, return_dict=False)
    return samples, single


def pad_samples(samples, extra_tokens: int):
    """Residuals for the noisy image's tokens, zero-padded for tokens that follow them (Kontext references): the
    reference adds a ControlNet's residuals to the generated image's tokens only."""
    if samples is None or not extra_tokens:
        return samples
    return [torch.nn.functional.pad(s, (0, 0, 0, extra_tokens)) for s in samples]


def controlnet_call_inputs(inputs) -> dict[str, Any]:
    """`controlnet_inputs` as the pipeline's values; what it cannot do is refused in one line."""
    inputs = list(inputs) if isinstance(inputs, (list, tuple)) else [inputs]
    if len(inputs) != 1:
        raise UserError(f"controlnet_inputs: {len(inputs)} given; one ControlNet at a time is supported")
    c = inputs[0]
    if c.controlnet_id != 0 or (c.start, c.end) != (1.0, 0.0) or c.inpaint_image is not None:
        raise UserError("controlnet_inputs: only image, inpaint_mask, processor_id and scale are supported "
                        "(controlnet_id 0, start 1, end 0: the ControlNet acts on every step; no inpaint_image)")
    if c.image is None:
        raise UserError("controlnet_inputs: the ControlNetInput has no image")
    return {"controlnet_image": c.image, "controlnet_inpaint_mask": c.inpaint_mask,
            "controlnet_processor_id": c.processor_id, "controlnet_scale": c.scale}



class _ControlNet(Feature):
    def prepare_call(self, pipe, values, cfg_scale, state):
        """The reference's `controlnet_inputs` as this feature's inputs."""
        inputs = values.pop("controlnet_inputs", None)
        if inputs is not None:
            if values.get("controlnet_image") is not None:
                raise UserError("give controlnet_inputs or controlnet_image, not both")
            for name, value in controlnet_call_inputs(inputs).items():  # what it gives stands for every input
                if value is None:
                    values.pop(name, None)
                else:
                    values[name] = value

    def denoise(self, pipe, call):
        """The ControlNet's residuals after each block, from the DiT's assembled inputs (or the prompt another
        feature gives it: `call.control_prompt`)."""
        v = call.values
        if v.get("controlnet_conditioning") is None:
            return
        controlnet = call.model("controlnet")
        if controlnet is None:
            raise UserError("a controlnet_image is given but no ControlNet is loaded: add its weights (e.g. "
                            "InstantX/FLUX.1-dev-Controlnet-Union-alpha:diffusion_pytorch_model.safetensors)")
        call.checkpointing(controlnet)
        call.before_blocks.append(lambda c: _residuals(c, controlnet))


def _residuals(call, controlnet) -> None:
    v = call.values
    text, ids, guidance = call.control_prompt or (call.text, call.text_ids, call.guidance)
    net = getattr(controlnet, "net", controlnet)  # the slot's wrapper, or a ControlNet itself
    scale = v.get("controlnet_scale")
    call.block_samples, call.single_block_samples = controlnet_samples(
        net, call.noisy, call.t, text, call.pooled, call.embedded_guidance(net, guidance), ids, call.img_ids,
        v["controlnet_conditioning"], v.get("controlnet_mode"), 1.0 if scale is None else float(scale))


COLUMNS = ("controlnet_image", "controlnet_inpaint_mask", "controlnet_processor_id")
CONTROLNET_FEATURE = _ControlNet(
    "controlnet", columns=COLUMNS[:1], models=("controlnet",), data_inputs=COLUMNS,
    model_fn_inputs=("controlnet_conditioning", "controlnet_mode", "controlnet_scale"),
    units=(FluxControlNetEmbedder(),), slots=("controlnet",), loss_models=("controlnet",),
    # --full_format original: a released ControlNet file's names; diffusers (the default): the slot's `models.0.`,
    # as the reference's trained files. Both load back (`controlnet_key`).
    native_keys={"controlnet": controlnet_native_keys},
    inputs={"controlnet_image": IMAGE, "controlnet_inpaint_mask": IMAGE, "controlnet_processor_id": VALUE},
    call_inputs=dict.fromkeys((*COLUMNS, "controlnet_scale", "controlnet_inputs")),
    flags={"controlnet_image": sample_input("A ControlNet's control image.", load="RGB"),
           "controlnet_inpaint_mask": sample_input("Inpainting-Beta ControlNet: the region to fill (light).",
                                                   load="RGB"),
           "controlnet_processor_id": sample_input("Union-alpha ControlNet: the control mode (canny, tile, depth, "
                                                   "blur, pose, gray, lq)."),
           "controlnet_scale": sample_input("The ControlNet's strength (default 1).", kind=float)},
    description="a ControlNet (Union-alpha, Upscaler, Inpainting-Beta, InfiniteYou's InfuseNet)")

__all__ = ["CONTROLNET", "CONTROLNET_FEATURE", "ControlNetInput", "FluxControlNetEmbedder",
           "FluxControlNetWithExtraCondition",
           "FluxMultiControlNet", "UNION_MODES", "control_mode", "controlnet_call_inputs",
           "controlnet_config_from_weights", "controlnet_key", "controlnet_native_keys", "controlnet_samples",
           "pad_samples"]
