"""Fun-Control (PAI's Wan2.1-Fun-{1.3B,14B}-Control, Fun-V1.1-{1.3B,14B}-Control, Wan2.2-Fun-A14B-Control) and
the DiT class of the Fun-Control-Camera models (camera.py has their inputs).

The control video is VAE-encoded and goes on channels between the noisy latents and the image condition: 16
control channels, then (Wan2.1) the image condition's 16 latent channels without its mask, or (Wan2.2 A14B) the
whole 20-channel I2V condition; zeros where no input image is given (and then a zero CLIP embedding for the DiTs
that take one). V1.1 and the A14B one add a reference image: its latents through the DiT's `ref_conv` (2 x 2) as
one leading frame of tokens (`wan_dit_forward(prefix_tokens=...)`), and its CLIP embedding in place of the input
image's where a CLIP encoder is loaded.

diffusers has no class with `ref_conv` or the camera `control_adapter`: `WanFunTransformer3DModel` is diffusers'
`WanTransformer3DModel` with them (the released files' key names: ref_conv.*, control_adapter.*), so everything
else loads, trains and saves as the Wan DiT does.
"""

from __future__ import annotations

import torch
from diffusers import WanTransformer3DModel
from diffusers.configuration_utils import register_to_config
from torch import nn

from ...core.features import ALIGNED_FRAMES, IMAGE, Feature
from ...core.units import PipelineUnit
from ...errors import UserError
from ...media.image import as_image_list
from ...models.detect import ComponentSpec
from .camera import WanCameraAdapter
from .image_features import dit_extra_channels
from .components import _dit_config, _dit_from_original, _strip_comfy_prefix
from .units import WanImageEmbedderCLIP, _per_sample, vae_encode, video_tensor

CLIP_TOKENS = 257  # a ViT-H/14 image's tokens: the reference's zero embedding when no image is given
CONTROL_CHANNELS = 16


class WanFunTransformer3DModel(WanTransformer3DModel):
    """diffusers' Wan DiT plus the Fun models' `ref_conv` (reference image latents -> one frame of tokens) and
    camera `control_adapter`, each present when its config entry is set."""

    @register_to_config
    def __init__(self, patch_size: tuple[int, ...] = (1, 2, 2), num_attention_heads: int = 40,
                 attention_head_dim: int = 128, in_channels: int = 16, out_channels: int = 16, text_dim: int = 4096,
                 freq_dim: int = 256, ffn_dim: int = 13824, num_layers: int = 40, cross_attn_norm: bool = True,
                 qk_norm: str | None = "rms_norm_across_heads", eps: float = 1e-6, image_dim: int | None = None,
                 added_kv_proj_dim: int | None = None, rope_max_seq_len: int = 1024,
                 pos_embed_seq_len: int | None = None, ref_conv_channels: int | None = None,
                 control_adapter_in_channels: int | None = None):
        super().__init__(patch_size, num_attention_heads, attention_head_dim, in_channels, out_channels, text_dim,
                         freq_dim, ffn_dim, num_layers, cross_attn_norm, qk_norm, eps, image_dim, added_kv_proj_dim,
                         rope_max_seq_len, pos_embed_seq_len)
        inner = num_attention_heads * attention_head_dim
        spatial = tuple(patch_size[1:])
        self.ref_conv = nn.Conv2d(ref_conv_channels, inner, kernel_size=spatial, stride=spatial) \
            if ref_conv_channels else None
        self.control_adapter = WanCameraAdapter(control_adapter_in_channels, inner, spatial) \
            if control_adapter_in_channels else None


def fun_config(heads: int, ffn: int, layers: int, in_channels: int, image: bool, ref_conv: bool = False,
               camera: bool = False) -> dict:
    return {**_dit_config(heads, ffn, layers, in_channels=in_channels, image=image),
            "_class_name": "WanFunTransformer3DModel", "ref_conv_channels": 16 if ref_conv else None,
            "control_adapter_in_channels": 24 if camera else None}


_13B, _14B = (12, 8960, 30), (40, 13824, 40)
# The reference's registry (diffsynth/configs/model_configs.py): input channels 16 latents + 16 control + 16 image
# latents (Wan2.1) or + 20 (mask + latents: Wan2.2); camera: 16 + 16 (Wan2.1) or + 20 (Wan2.2).
FUN_DIT_CONFIGS = {
    "Wan2.1-Fun-1.3B-Control": fun_config(*_13B, 48, image=True),
    "Wan2.1-Fun-14B-Control": fun_config(*_14B, 48, image=True),
    "Wan2.1-Fun-V1.1-1.3B-Control": fun_config(*_13B, 48, image=True, ref_conv=True),
    "Wan2.1-Fun-V1.1-14B-Control": fun_config(*_14B, 48, image=True, ref_conv=True),
    "Wan2.1-Fun-V1.1-1.3B-Control-Camera": fun_config(*_13B, 32, image=True, camera=True),
    "Wan2.1-Fun-V1.1-14B-Control-Camera": fun_config(*_14B, 32, image=True, camera=True),
    "Wan2.2-Fun-A14B-Control expert": fun_config(*_14B, 52, image=False, ref_conv=True),
    "Wan2.2-Fun-A14B-Control-Camera expert": fun_config(*_14B, 36, image=False, camera=True),
}

FUN_DIT_ORIGINAL = ComponentSpec(
    name="dit", library=__name__, class_name="WanFunTransformer3DModel", extra_slots=("dit2",),
    known_configs=FUN_DIT_CONFIGS,
    marker_keys=("patch_embedding.weight", "head.modulation", "blocks.0.self_attn.q.weight"),
    normalize_key=_strip_comfy_prefix, convert_state_dict=_dit_from_original, foreign_config_classes=("WanModel",),
    description="Wan Fun-Control / Control-Camera DiT (PAI's original layout: ref_conv, control_adapter)")


# -- units ----------------------------------------------------------------------------------------------------
def _per_clip(value, batch_size: int) -> list:
    if isinstance(value, (list, tuple)) and value and isinstance(value[0], (list, tuple)):
        return list(value)
    return [value] * batch_size


class WanFunControlEmbedder(PipelineUnit):
    """The control video's VAE latents (B, 16, latent frames, h, w)."""

    feature = "fun_control"
    inputs = ("control_video", "height", "width", "batch_size")
    outputs = ("control_latents",)
    models = ("vae",)
    skip_without = ("control_video",)

    def process(self, pipe, control_video, height, width, batch_size):
        clips = _per_clip(control_video, int(batch_size or 1))
        latents = torch.cat([vae_encode(pipe, video_tensor(as_image_list(c), height, width)) for c in clips])
        return {"control_latents": latents.to(pipe.torch_dtype)}


class WanFunReferenceEmbedder(PipelineUnit):
    """The reference image's VAE latents (B, 16, 1, h, w) and, where a CLIP image encoder is loaded, its CLIP
    embedding (which stands in for the input image's)."""

    feature = "fun_reference"
    inputs = ("reference_image", "height", "width", "batch_size")
    outputs = ("reference_latents", "reference_image_embeds")
    models = ("vae", "image_encoder")
    skip_without = ("reference_image",)

    def process(self, pipe, reference_image, height, width, batch_size):
        n = int(batch_size or 1)
        images = _per_sample(reference_image, n)
        out = {"reference_latents": torch.cat([vae_encode(pipe, video_tensor([im], height, width))
                                               for im in images]).to(pipe.torch_dtype)}
        if pipe.models.get("image_encoder") is not None:
            clip = WanImageEmbedderCLIP().process(pipe, images if n > 1 else images[0], None, height, width, n)
            out["reference_image_embeds"] = clip["image_embeds"]
        return out


# -- model_fn's part --------------------------------------------------------------------------------------------
def fun_control_dit_inputs(dit, latents: torch.Tensor, control_latents: torch.Tensor,
                           condition: torch.Tensor | None = None, image_embeds: torch.Tensor | None = None,
                           reference_image_embeds: torch.Tensor | None = None):
    """(the DiT's input channels: latents, control latents, image condition; its CLIP image embedding or None)."""
    config = dit.config
    image_channels = config.in_channels - latents.shape[1] - control_latents.shape[1]
    if image_channels < 0:
        raise UserError(f"control_video was given but this Wan DiT takes {config.in_channels} input channels "
                        f"(a Fun-Control DiT takes the control latents)")
    b = latents.shape[0]
    takes_clip = config.image_dim is not None
    if condition is None or (takes_clip and image_embeds is None):
        # no input image (or, for a DiT that takes CLIP, no CLIP embedding of it): zeros for both, as the reference
        image = latents.new_zeros(b, image_channels, *latents.shape[2:])
        if takes_clip:
            image_embeds = latents.new_zeros(b, CLIP_TOKENS, config.image_dim)
    else:
        image = condition[:, condition.shape[1] - image_channels:]  # Wan2.1: the latents without the mask
    if reference_image_embeds is not None:
        image_embeds = reference_image_embeds
    if config.image_dim is None:
        image_embeds = None
    x = torch.cat([latents, control_latents.to(latents.dtype), image.to(latents.dtype)], dim=1)
    return x, image_embeds


def reference_tokens(dit, reference_latents: torch.Tensor) -> torch.Tensor:
    """ref_conv over the reference image's latents: (B, 16, 1, h, w) -> (B, h/2 * w/2, D)."""
    if getattr(dit, "ref_conv", None) is None:
        raise UserError("reference_image was given but this Wan DiT has no ref_conv (Fun-Control V1.1 and "
                        "Wan2.2-Fun-A14B-Control have one)")
    z = reference_latents[:, :, 0] if reference_latents.dim() == 5 else reference_latents
    return dit.ref_conv(z.to(dit.ref_conv.weight.dtype)).flatten(2).transpose(1, 2)




class _FunControl(Feature):
    def check(self, context, features):
        extra = dit_extra_channels(context)
        if extra is not None and extra < 16:
            raise UserError("control_video: this Wan DiT takes no control latents (a Fun-Control DiT does)")

    def denoise(self, pipe, call):
        """The control latents (and the image condition) on the channels, the reference's CLIP for the input's."""
        v = call.values
        call.x, call.image_embeds = fun_control_dit_inputs(call.dit, call.x, v["control_latents"], v.get("condition"),
                                                           call.image_embeds, v.get("reference_image_embeds"))
        call.channels_done = True


class _FunReference(Feature):
    def check(self, context, features):
        dit = context.config("dit")
        if dit is not None and not dit.get("ref_conv_channels"):
            raise UserError("reference_image: this Wan DiT has no ref_conv (Fun-Control V1.1 and "
                            "Wan2.2-Fun-A14B-Control have one)")

    def denoise(self, pipe, call):
        """The reference image's tokens in front of the video's; its CLIP stands in for the input image's."""
        v = call.values
        if v.get("reference_latents") is not None:
            call.prefix_tokens = reference_tokens(call.dit, v["reference_latents"])
        if v.get("reference_image_embeds") is not None and call.dit.config.image_dim is not None:
            call.image_embeds_instead = v["reference_image_embeds"]


FUN_CONTROL = _FunControl(
    "fun_control", columns=("control_video",), model_fn_inputs=("control_latents",), units=(WanFunControlEmbedder(),),
    inputs={"control_video": ALIGNED_FRAMES}, call_inputs={"control_video": None},
    description="Fun-Control: the control video's VAE latents on channels before the image condition")
FUN_REFERENCE = _FunReference(
    "fun_reference", columns=("reference_image",), model_fn_inputs=("reference_latents", "reference_image_embeds"),
    units=(WanFunReferenceEmbedder(),), inputs={"reference_image": IMAGE}, call_inputs={"reference_image": None},
    description="Fun-Control V1.1 / Wan2.2-Fun-A14B-Control: a reference image through the DiT's ref_conv (and its "
                "CLIP embedding)")

__all__ = ["FUN_DIT_CONFIGS", "FUN_DIT_ORIGINAL", "WanFunControlEmbedder", "WanFunReferenceEmbedder",
           "WanFunTransformer3DModel", "fun_control_dit_inputs", "fun_config", "reference_tokens", "FUN_CONTROL", "FUN_REFERENCE"]
