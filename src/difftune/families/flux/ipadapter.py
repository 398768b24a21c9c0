"""InstantX's FLUX.1-dev IP-Adapter (`InstantX/FLUX.1-dev-IP-Adapter:ip-adapter.bin`, slot `ipadapter`) with
SigLIP-so400m (`google/siglip-so400m-patch14-384:model.safetensors`, slot `ipadapter_image_encoder`).

The release is a pickled {"image_proj": {...}, "ip_adapter": {...}} (read through torch.load(weights_only=True),
models/files.py): `image_proj` is an MLP (1152 -> 2304 -> 128 x 4096, LayerNorm) turning SigLIP's pooled image
feature into 128 tokens; `ip_adapter.<i>` holds one block's `to_k_ip` / `to_v_ip` (no bias) for each of the
DiT's 57 blocks (double blocks first). diffusers has the projection (`IPAdapterFaceIDImageProjection`, keys
`ff.net.0.proj` / `ff.net.2` for `proj.0` / `proj.2`) but its FLUX IP-Adapter support is XLabs' (biased k/v in the
double blocks only, added after the feed-forward), so the per-block keys/values and their attention are ours
(`attention.py`), in the release's names. The reference's own trained files (`--remove_prefix_in_ckpt
pipe.ipadapter.`: `ipadapter_modules.<i>.*`) load too.

Units and model_fn (as the reference's `FluxImageUnit_IPAdapter`): the unit runs SigLIP on `ipadapter_images`
(resized to 384x384 bicubic, in [-1, 1]) and writes the pooled features (`ipadapter_image_embeds`, (B, n, 1152));
the IP-Adapter runs in model_fn, so training it (`--trainable_models ipadapter`) keeps SigLIP in stage 1. With
classifier-free guidance the negative side reads zero features, as the reference.
"""

from __future__ import annotations

import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.models.embeddings import IPAdapterFaceIDImageProjection
from diffusers.models.normalization import RMSNorm
from PIL import Image
from torch import nn

from ...core.features import IMAGES, Feature
from ...core.options import sample_input
from ...core.units import PipelineUnit
from ...errors import UserError
from ...media.image import as_image_list, images_to_tensor
from ...models.detect import ComponentSpec

SIGLIP_SIZE = 384


class IPAdapterKV(nn.Module):
    """One block's image-prompt keys and values; keys are RMS-normalised per head (no weight), as InstantX's."""

    def __init__(self, cross_attention_dim: int, inner_dim: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.to_k_ip = nn.Linear(cross_attention_dim, inner_dim, bias=False)
        self.to_v_ip = nn.Linear(cross_attention_dim, inner_dim, bias=False)
        self.norm_added_k = RMSNorm(head_dim, eps=1e-5, elementwise_affine=False)

    def forward(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        k = self.norm_added_k(self.to_k_ip(tokens).unflatten(-1, (-1, self.head_dim)))
        return k, self.to_v_ip(tokens).unflatten(-1, (-1, self.head_dim))


class FluxIPAdapter(ModelMixin, ConfigMixin):
    """The InstantX FLUX IP-Adapter: pooled image features (B, n, image_embed_dim) -> each block's (k, v),
    (B, n * num_tokens, heads, head_dim) each."""

    @register_to_config
    def __init__(self, image_embed_dim: int = 1152, cross_attention_dim: int = 4096, num_tokens: int = 128,
                 proj_mult: int = 2, num_blocks: int = 57, num_attention_heads: int = 24,
                 attention_head_dim: int = 128):
        super().__init__()
        self.image_proj = IPAdapterFaceIDImageProjection(image_embed_dim, cross_attention_dim, mult=proj_mult,
                                                         num_tokens=num_tokens)
        inner = num_attention_heads * attention_head_dim
        self.ip_adapter = nn.ModuleList([IPAdapterKV(cross_attention_dim, inner, attention_head_dim)
                                         for _ in range(num_blocks)])

    def forward(self, image_embeds: torch.Tensor) -> list[tuple[torch.Tensor, torch.Tensor]]:
        b, n = image_embeds.shape[:2]
        weight = self.image_proj.ff.net[0].proj.weight
        tokens = self.image_proj(image_embeds.reshape(b * n, -1).to(weight.device, weight.dtype))
        tokens = tokens.reshape(b, n * self.config.num_tokens, -1)
        return [block(tokens) for block in self.ip_adapter]


# -- recognition ----------------------------------------------------------------------------------------------

_PROJ = {"image_proj.proj.0.": "image_proj.ff.net.0.proj.", "image_proj.proj.2.": "image_proj.ff.net.2."}


def ipadapter_key(key: str) -> str:
    """The release's (and the reference's saved) names -> this module's."""
    for prefix in ("pipe.ipadapter.", "ipadapter."):
        if key.startswith(prefix):
            key = key[len(prefix):]
    if key.startswith("ipadapter_modules."):
        key = "ip_adapter." + key[len("ipadapter_modules."):]
    for old, new in _PROJ.items():
        if key.startswith(old):
            return new + key[len(old):]
    return key


def ipadapter_native_keys(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """This module's state dict in the release's flat names (`image_proj.proj.0.weight`, `ip_adapter.0.to_k_ip...`)."""
    out = {}
    for key, t in state.items():
        for old, new in _PROJ.items():
            if key.startswith(new):
                key = old + key[len(new):]
                break
        out[key] = t
    return out


def ipadapter_config_from_weights(shapes: dict[str, tuple[int, ...]]) -> dict | None:
    up, down = shapes.get("image_proj.ff.net.0.proj.weight"), shapes.get("image_proj.ff.net.2.weight")
    norm, k = shapes.get("image_proj.norm.weight"), shapes.get("ip_adapter.0.to_k_ip.weight")
    if up is None or down is None or norm is None or k is None or down[0] % norm[0] or up[0] % up[1]:
        return None
    blocks = {int(key.split(".")[1]) for key in shapes if key.startswith("ip_adapter.")}
    # the head count is not in the weights: FLUX.1's head dim is 128
    head_dim = 128 if k[0] % 128 == 0 else None
    if head_dim is None:
        return None
    return {"image_embed_dim": up[1], "cross_attention_dim": norm[0], "num_tokens": down[0] // norm[0],
            "proj_mult": up[0] // up[1], "num_blocks": max(blocks) + 1, "num_attention_heads": k[0] // head_dim,
            "attention_head_dim": head_dim}


INSTANTX_IPADAPTER_CONFIG = {"image_embed_dim": 1152, "cross_attention_dim": 4096, "num_tokens": 128, "proj_mult": 2,
                             "num_blocks": 57, "num_attention_heads": 24, "attention_head_dim": 128}

IPADAPTER = ComponentSpec(
    name="ipadapter", library=__name__, class_name="FluxIPAdapter",
    known_configs={"InstantX/FLUX.1-dev-IP-Adapter": INSTANTX_IPADAPTER_CONFIG},
    marker_keys=("image_proj.ff.net.0.proj.weight", "ip_adapter.0.to_k_ip.weight"), normalize_key=ipadapter_key,
    infer_config=ipadapter_config_from_weights, description="FLUX.1 IP-Adapter (InstantX)")

# google/siglip-so400m-patch14-384's vision tower (the file is the whole SigLIP: its text tower is dropped; the
# repository's config.json describes the whole SiglipModel, so the weights are recognised instead)
SIGLIP_SO400M_VISION_CONFIG = {
    "architectures": ["SiglipVisionModel"], "model_type": "siglip_vision_model", "hidden_size": 1152,
    "image_size": 384, "intermediate_size": 4304, "num_attention_heads": 16, "num_hidden_layers": 27,
    "patch_size": 14, "num_channels": 3, "hidden_act": "gelu_pytorch_tanh", "layer_norm_eps": 1e-6,
    "attention_dropout": 0.0, "vision_use_head": True,
}


def siglip_vision_key(key: str) -> str:
    """Checkpoints name SigLIP's vision tower `vision_model.*`; transformers>=5's SiglipVisionModel has no such level."""
    return key[len("vision_model."):] if key.startswith("vision_model.") else key


def vision_tower_only(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A whole SigLIP checkpoint's vision tower (text tower, logit scale and bias dropped)."""
    if not any(k.startswith("text_model.") for k in state):
        raise KeyError("not a whole SigLIP checkpoint")
    return {k: v for k, v in state.items() if not k.startswith("text_model.") and k not in ("logit_scale", "logit_bias")}


def siglip_vision_config(shapes: dict[str, tuple[int, ...]]) -> dict | None:
    """A SigLIP vision tower's config from its weights (any size; the head count is 16 at so400m's width, else
    width / 64 as SigLIP's other sizes)."""
    patch = shapes.get("embeddings.patch_embedding.weight")
    pos = shapes.get("embeddings.position_embedding.weight")
    fc1 = shapes.get("encoder.layers.0.mlp.fc1.weight")
    if patch is None or pos is None or fc1 is None:
        return None
    width, side = patch[0], int(round(pos[0] ** 0.5))
    layers = 1 + max(int(k.split(".")[2]) for k in shapes if k.startswith("encoder.layers."))
    heads = 16 if width == 1152 else max(1, width // 64)
    return {**SIGLIP_SO400M_VISION_CONFIG, "hidden_size": width, "image_size": side * patch[2],
            "patch_size": patch[2], "num_channels": patch[1], "intermediate_size": fc1[0], "num_hidden_layers": layers,
            "num_attention_heads": heads, "vision_use_head": "head.probe" in shapes}


IPADAPTER_IMAGE_ENCODER = ComponentSpec(
    name="ipadapter_image_encoder", library="transformers", class_name="SiglipVisionModel",
    config_class_name="SiglipVisionConfig",
    known_configs={"google/siglip-so400m-patch14-384 vision tower": SIGLIP_SO400M_VISION_CONFIG},
    marker_keys=("head.probe", "text_model.embeddings.token_embedding.weight"), normalize_key=siglip_vision_key,
    convert_state_dict=vision_tower_only, infer_config=siglip_vision_config, foreign_config_classes=("SiglipModel",),
    description="SigLIP so400m image encoder (IP-Adapter)")


# -- the unit -------------------------------------------------------------------------------------------------

def siglip_pixels(images, size: int = SIGLIP_SIZE) -> torch.Tensor:
    """Images -> (n, 3, size, size) in [-1, 1], bicubic (the reference's SigLIP input; SiglipImageProcessor's)."""
    return images_to_tensor([i.convert("RGB").resize((size, size), resample=Image.BICUBIC)
                             for i in as_image_list(images)])


def _per_sample_images(value, n: int) -> list[list[Image.Image]]:
    if isinstance(value, Image.Image):
        return [[value]] * n
    items = list(value)
    if items and all(isinstance(i, Image.Image) for i in items):
        return [items] * n
    if len(items) == n and all(isinstance(i, (list, tuple)) and all(isinstance(x, Image.Image) for x in i)
                               for i in items):
        return [list(i) for i in items]
    raise UserError(f"ipadapter_images: expected an image, a list of images or one list per sample, "
                    f"got {type(value).__name__}")


class FluxIPAdapterImageEncoder(PipelineUnit):
    """`ipadapter_images` -> SigLIP's pooled features (B, n images, 1152) for the IP-Adapter in model_fn; the negative
    side gets zeros (the reference's unconditional image prompt)."""

    feature = "ipadapter"
    before = ("FluxClipEmbedder",)
    inputs = ("ipadapter_images", "ipadapter_scale", "batch_size")
    outputs = ("ipadapter_image_embeds", "negative_ipadapter_image_embeds", "ipadapter_scale")
    models = ("ipadapter_image_encoder",)
    batching = {"ipadapter_scale": "same"}
    skip_without = ("ipadapter_images",)

    def process(self, pipe, ipadapter_images, ipadapter_scale, batch_size):
        per_sample = _per_sample_images(ipadapter_images, int(batch_size or 1))
        if len({len(s) for s in per_sample}) > 1:
            raise UserError("ipadapter_images: samples of one batch have different numbers of images "
                            "(--batch_size 1 avoids it)")
        encoder = pipe.ipadapter_image_encoder
        size = encoder.config.image_size  # 384 for so400m, the reference's fixed size
        pixels = torch.cat([siglip_pixels(s, size) for s in per_sample]).to(pipe.device, encoder.dtype)
        pooled = encoder(pixel_values=pixels).pooler_output
        embeds = pooled.reshape(len(per_sample), -1, pooled.shape[-1]).to(pipe.torch_dtype)
        return {"ipadapter_image_embeds": embeds, "negative_ipadapter_image_embeds": torch.zeros_like(embeds),
                "ipadapter_scale": None if ipadapter_scale is None else float(ipadapter_scale)}



class _IPAdapter(Feature):
    def denoise(self, pipe, call):
        """The IP-Adapter's keys and values for every block's attention."""
        embeds = call.values.get("ipadapter_image_embeds")
        if embeds is None:
            return
        ipadapter = call.model("ipadapter")
        if ipadapter is None:
            raise UserError("ipadapter_images are given but no IP-Adapter is loaded: add its weights "
                            "(InstantX/FLUX.1-dev-IP-Adapter:ip-adapter.bin)")
        scale = call.values.get("ipadapter_scale")
        call.attention["ip_kv"] = ipadapter(embeds.to(call.device))
        call.attention["ip_scale"] = 1.0 if scale is None else float(scale)


IPADAPTER_FEATURE = _IPAdapter(
    "ipadapter", columns=("ipadapter_images",), models=("ipadapter",),
    model_fn_inputs=("ipadapter_image_embeds", "ipadapter_scale"), units=(FluxIPAdapterImageEncoder(),),
    slots=("ipadapter", "ipadapter_image_encoder"), loss_models=("ipadapter",), inputs={"ipadapter_images": IMAGES},
    call_inputs={"ipadapter_images": None, "ipadapter_scale": None},
    flags={"ipadapter_images": sample_input("IP-Adapter: an image prompt (repeat for several).", repeat=True,
                                             load="RGB"),
           "ipadapter_scale": sample_input("IP-Adapter: its strength (default 1).", kind=float)},
    description="InstantX's IP-Adapter: SigLIP features attended in every block")

__all__ = ["IPADAPTER_FEATURE", "FluxIPAdapter", "FluxIPAdapterImageEncoder", "IPADAPTER", "IPADAPTER_IMAGE_ENCODER",
           "IPAdapterKV", "ipadapter_key", "ipadapter_native_keys", "siglip_pixels"]
