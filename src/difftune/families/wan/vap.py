"""Video-As-Prompt (ByteDance/Video-As-Prompt-Wan2.1-14B): a mixture-of-transformers branch (`vap`) beside Wan2.1
I2V-14B that reads a reference clip (`vap_video`) and joins the DiT's self-attention in every fourth block.

The released `transformer/diffusion_pytorch_model*.safetensors` hold both models in diffusers' names: the Wan I2V
DiT (`blocks.N.attn1.to_q`, ...) and the branch under `_mot_ref` names (`patch_embedding_mot_ref`,
`condition_embedder_mot_ref.*`, `blocks.N.attn1_mot_ref.*`, ... in the blocks that have one), with a config.json of
class `WanTransformer3DMOTModel`. Here they are two slots, as the reference has them:

  * `dit`: diffusers' `WanTransformer3DModel` (`WanTransformer3DMOTModel` below is that class under the released
    config's name, so the config.json configures it; the `_mot_ref` tensors are left out);
  * `vap`: `WanVAPModel`, the branch in the reference's `MotWanModel` names (`blocks.M.self_attn.q`, `img_emb.proj.1`,
    `time_projection.1`, ... with M the branch's own block index), so a fully trained `vap` saved here loads with
    the reference's `pipe.vap.load_state_dict`. `vap_from_released` converts the released names.

One file fills both slots: `VAP` is a companion component (recognised in the files recognised as the DiT; its
heads are Wan's 128 channels wide, as the released 5120 / 40, and its blocks sit beside DiT blocks 0, 4, 8, ...).

Training (`lora|full/Video-As-Prompt-Wan2.1-14B.sh`, `--extra_inputs vap_video,input_image`): the DiT is conditioned
as Wan2.1 I2V-14B on the clip's first frame; `vap_video` (a clip as long as the training clip) gives the branch's
input (its VAE latents + the I2V condition of its first frame: 36 channels), its first frame's CLIP embedding and
`vap_prompt`'s UMT5 embedding ("" when the data has none, as the reference trains). The branch sees timestep 1 and
frames at RoPE positions -f..-1 (before the clip's).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from diffusers import WanTransformer3DModel
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.modeling_utils import ModelMixin
from torch import nn

from ...core.checkpointing import gradient_checkpoint_forward
from ...core.features import Feature
from ...core.units import PipelineUnit
from ...errors import UserError
from ...models.detect import ComponentSpec
from .components import WAN_DIT_CONFIGS
from .s2v import RMSNorm, sinusoidal
from .pipeline import CLIP, I2V
from .units import (MAX_PROMPT_TOKENS, WanImageEmbedderCLIP, WanImageEmbedderVAE,
                    WanInputVideoEmbedder, WanNoiseInitializer, WanPromptEmbedder, WanShapeChecker, _per_sample,
                    frames_of, vae_encode, video_tensor)
from .variant import WanVariantPipeline, dit_class

FEATURE = "vap"
MOT = "_mot_ref"
VAP_MOT_LAYERS = [0, 4, 8, 12, 16, 20, 24, 28, 32, 36]


class WanTransformer3DMOTModel(WanTransformer3DModel):
    """diffusers' Wan DiT under the released VAP config's class name (its `_mot_ref` part is the `vap` slot)."""


# -- the branch --------------------------------------------------------------------------------------------

class _Attention(nn.Module):
    """Wan's attention in the reference's names; cross-attention with `image_input` also attends to the image
    tokens through k_img / v_img."""

    def __init__(self, dim: int, heads: int, eps: float, image_input: bool = False):
        super().__init__()
        self.heads = heads
        self.q, self.k, self.v, self.o = (nn.Linear(dim, dim) for _ in range(4))
        self.norm_q, self.norm_k = RMSNorm(dim, eps), RMSNorm(dim, eps)
        if image_input:
            self.k_img, self.v_img = nn.Linear(dim, dim), nn.Linear(dim, dim)
            self.norm_k_img = RMSNorm(dim, eps)


class _MLP(nn.Module):
    def __init__(self, cin: int, cout: int):
        super().__init__()
        self.proj = nn.Sequential(nn.LayerNorm(cin), nn.Linear(cin, cin), nn.GELU(), nn.Linear(cin, cout),
                                  nn.LayerNorm(cout))

    def forward(self, x):
        return self.proj(x)


class VAPBlock(nn.Module):
    def __init__(self, dim: int, heads: int, ffn_dim: int, eps: float, image_input: bool):
        super().__init__()
        self.self_attn = _Attention(dim, heads, eps)
        self.cross_attn = _Attention(dim, heads, eps, image_input)
        self.norm1 = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.norm2 = nn.LayerNorm(dim, eps=eps, elementwise_affine=False)
        self.norm3 = nn.LayerNorm(dim, eps=eps)
        self.ffn = nn.Sequential(nn.Linear(dim, ffn_dim), nn.GELU(approximate="tanh"), nn.Linear(ffn_dim, dim))
        self.modulation = nn.Parameter(torch.randn(1, 6, dim) / dim ** 0.5)


class WanVAPModel(ModelMixin, ConfigMixin):
    """The Video-As-Prompt branch (the reference's MotWanModel): its own patch, time, text and image embeddings
    and one block beside each DiT block in `mot_layers`."""

    _supports_gradient_checkpointing = True

    @register_to_config
    def __init__(self, mot_layers=tuple(VAP_MOT_LAYERS), patch_size=(1, 2, 2), has_image_input: bool = True,
                 dim: int = 5120, num_heads: int = 40, ffn_dim: int = 13824, freq_dim: int = 256,
                 text_dim: int = 4096, in_dim: int = 36, image_dim: int = 1280, eps: float = 1e-6):
        super().__init__()
        self.patch_embedding = nn.Conv3d(in_dim, dim, kernel_size=tuple(patch_size), stride=tuple(patch_size))
        self.text_embedding = nn.Sequential(nn.Linear(text_dim, dim), nn.GELU(approximate="tanh"),
                                            nn.Linear(dim, dim))
        self.time_embedding = nn.Sequential(nn.Linear(freq_dim, dim), nn.SiLU(), nn.Linear(dim, dim))
        self.time_projection = nn.Sequential(nn.SiLU(), nn.Linear(dim, dim * 6))
        if has_image_input:
            self.img_emb = _MLP(image_dim, dim)
        self.blocks = nn.ModuleList([VAPBlock(dim, num_heads, ffn_dim, eps, has_image_input) for _ in mot_layers])
        self.layer_of = {int(block): n for n, block in enumerate(mot_layers)}  # DiT block -> branch block

    @property
    def head_dim(self) -> int:
        return self.config.dim // self.config.num_heads


def _rope_cos_sin(head_dim: int, grid: tuple[int, int, int], frame0: int = 0, theta: float = 10000.0):
    """diffusers' Wan RoPE tables ((1, tokens, 1, head_dim) cos and sin, each frequency on a channel pair),
    frames from `frame0`."""
    f, h, w = grid
    h_dim = 2 * (head_dim // 6)
    dims = (head_dim - 2 * h_dim, h_dim, h_dim)
    tables = []
    for axis, (n, d) in enumerate(zip((f, h, w), dims)):
        start = frame0 if axis == 0 else 0
        inv = 1.0 / (theta ** (torch.arange(0, d, 2, dtype=torch.float64)[: d // 2] / d))
        angles = torch.arange(start, start + n, dtype=torch.float64)[:, None] * inv[None]
        tables.append(angles.repeat_interleave(2, dim=1))
    full = torch.cat([tables[0][:, None, None].expand(f, h, w, -1), tables[1][None, :, None].expand(f, h, w, -1),
                      tables[2][None, None, :].expand(f, h, w, -1)], dim=-1).reshape(1, f * h * w, 1, head_dim)
    return full.cos(), full.sin()


def _rotate(x, cos, sin):
    """diffusers' Wan rotation of (B, S, H, D) by interleaved tables."""
    x1, x2 = x.unflatten(-1, (-1, 2)).unbind(-1)
    c, s = cos[..., 0::2], sin[..., 1::2]
    out = torch.stack([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1).flatten(-2)
    return out.type_as(x)


def _joint_attention(q, k, v):  # (B, S, H, D) each
    out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2))
    return out.transpose(1, 2).flatten(2)


def _vap_cross(attn: _Attention, x, context, image_tokens: int):
    img, ctx = context[:, :image_tokens], context[:, image_tokens:]
    q = attn.norm_q(attn.q(x))
    heads = attn.heads
    split = lambda t: t.unflatten(2, (heads, -1))  # noqa: E731
    out = _joint_attention(split(q), split(attn.norm_k(attn.k(ctx))), split(attn.v(ctx)))
    if image_tokens and hasattr(attn, "k_img"):
        out = out + _joint_attention(split(q), split(attn.norm_k_img(attn.k_img(img))), split(attn.v_img(img)))
    return attn.o(out)


def joint_block(block, vblock: VAPBlock, x, context, temb, rope, x_vap, context_vap, temb_vap, rope_vap,
                image_tokens_vap: int):
    """One diffusers Wan block and its branch block: the self-attention of both token sets is one attention
    over the two (each side with its own projections, norms and RoPE); cross-attention and FFN stay apart."""
    shift, scale, gate, c_shift, c_scale, c_gate = (block.scale_shift_table + temb.float()).chunk(6, dim=1)
    vshift, vscale, vgate, vc_shift, vc_scale, vc_gate = (vblock.modulation + temb_vap.float()).chunk(6, dim=1)
    attn = block.attn1
    h = (block.norm1(x.float()) * (1 + scale) + shift).type_as(x)
    q = attn.norm_q(attn.to_q(h)).unflatten(2, (attn.heads, -1))
    k = attn.norm_k(attn.to_k(h)).unflatten(2, (attn.heads, -1))
    v = attn.to_v(h).unflatten(2, (attn.heads, -1))
    q, k = _rotate(q, *rope), _rotate(k, *rope)
    va = vblock.self_attn
    hv = (vblock.norm1(x_vap.float()) * (1 + vscale) + vshift).type_as(x_vap)
    qv = va.norm_q(va.q(hv)).unflatten(2, (va.heads, -1))
    kv = va.norm_k(va.k(hv)).unflatten(2, (va.heads, -1))
    vv = va.v(hv).unflatten(2, (va.heads, -1))
    qv, kv = _rotate(qv, *rope_vap), _rotate(kv, *rope_vap)
    joint = _joint_attention(torch.cat([q, qv], dim=1), torch.cat([k, kv], dim=1), torch.cat([v, vv], dim=1))
    out, out_vap = joint[:, :q.shape[1]].type_as(x), joint[:, q.shape[1]:].type_as(x_vap)
    x = (x.float() + attn.to_out[1](attn.to_out[0](out)) * gate).type_as(x)
    x_vap = (x_vap.float() + va.o(out_vap) * vgate).type_as(x_vap)
    # the DiT's cross-attention and FFN, as diffusers' block runs them
    x = x + block.attn2(block.norm2(x.float()).type_as(x), context, None, None)
    h = (block.norm3(x.float()) * (1 + c_scale) + c_shift).type_as(x)
    x = (x.float() + block.ffn(h).float() * c_gate).type_as(x)
    # the branch's
    x_vap = x_vap + _vap_cross(vblock.cross_attn, vblock.norm3(x_vap), context_vap, image_tokens_vap)
    hv = (vblock.norm2(x_vap.float()) * (1 + vc_scale) + vc_shift).type_as(x_vap)
    x_vap = (x_vap.float() + vblock.ffn(hv).float() * vc_gate).type_as(x_vap)
    return x, x_vap


def model_fn_wan_vap(dit, vap: WanVAPModel | None, latents: torch.Tensor, timestep: torch.Tensor,
                     prompt_embeds: torch.Tensor, image_embeds: torch.Tensor | None = None,
                     condition: torch.Tensor | None = None, vap_hidden_state: torch.Tensor | None = None,
                     vap_clip_feature: torch.Tensor | None = None, context_vap: torch.Tensor | None = None,
                     use_gradient_checkpointing: bool = False, use_gradient_checkpointing_offload: bool = False,
                     **_: Any) -> torch.Tensor:
    """Wan2.1 I2V DiT call (diffusers' `WanTransformer3DModel`, step by step) with the Video-As-Prompt branch
    joining the self-attention of its blocks."""
    if vap is None or vap_hidden_state is None:
        raise UserError("Video-As-Prompt needs its branch and a reference clip: --extra_inputs vap_video")
    if context_vap is None or vap_clip_feature is None:
        raise UserError("Video-As-Prompt needs the reference clip's CLIP and prompt embeddings (image and text "
                        "encoders loaded)")
    dtype = dit.dtype if dit.dtype.is_floating_point else latents.dtype
    b = latents.shape[0]
    x = latents if condition is None else torch.cat([latents, condition.to(latents.dtype)], dim=1)
    x = x.to(dtype)
    pt, ph, pw = dit.config.patch_size
    grid = (x.shape[2] // pt, x.shape[3] // ph, x.shape[4] // pw)
    rope = dit.rope(x)
    hidden = dit.patch_embedding(x).flatten(2).transpose(1, 2).contiguous()
    t = timestep.to(x.device).reshape(-1).expand(b)
    temb, tproj, context, image = dit.condition_embedder(
        t, prompt_embeds.to(dtype), None if image_embeds is None else image_embeds.to(dtype))
    tproj = tproj.unflatten(1, (6, -1))
    if image is not None:
        context = torch.cat([image, context], dim=1)
    # the branch: its tokens, timestep 1, frames before the clip's
    vc = vap.config
    vdtype = vap.dtype if vap.dtype.is_floating_point else dtype
    x_vap = vap.patch_embedding(vap_hidden_state.to(vdtype)).flatten(2).transpose(1, 2)
    vgrid = tuple(n // p for n, p in zip(vap_hidden_state.shape[2:], vc.patch_size))
    if vgrid != grid:
        raise UserError(f"the Video-As-Prompt clip's latents {tuple(vap_hidden_state.shape[2:])} differ from the "
                        f"clip's {tuple(latents.shape[2:])}: give vap_video as many frames and the same size")
    temb_vap = vap.time_embedding(sinusoidal(vc.freq_dim, torch.ones(b, device=x.device)).to(vdtype))
    tproj_vap = vap.time_projection(temb_vap).unflatten(1, (6, vc.dim))
    rope_vap = tuple(r.to(x.device) for r in _rope_cos_sin(vap.head_dim, grid, frame0=-grid[0]))
    image_tokens = vap_clip_feature.shape[1] if vc.has_image_input else 0
    ctx_vap = vap.text_embedding(context_vap.to(vdtype))
    if vc.has_image_input:
        ctx_vap = torch.cat([vap.img_emb(vap_clip_feature.to(vdtype)), ctx_vap], dim=1)
    for i, block in enumerate(dit.blocks):
        if i in vap.layer_of:
            hidden, x_vap = gradient_checkpoint_forward(
                joint_block, use_gradient_checkpointing, use_gradient_checkpointing_offload, block,
                vap.blocks[vap.layer_of[i]], hidden, context, tproj, rope, x_vap, ctx_vap, tproj_vap, rope_vap,
                image_tokens)
        else:
            hidden = gradient_checkpoint_forward(block, use_gradient_checkpointing, use_gradient_checkpointing_offload,
                                                 hidden, context, tproj, rope)
    shift, scale = (dit.scale_shift_table + temb.unsqueeze(1)).chunk(2, dim=1)
    hidden = (dit.norm_out(hidden.float()) * (1 + scale) + shift).type_as(hidden)
    hidden = dit.proj_out(hidden).reshape(b, *grid, pt, ph, pw, -1).permute(0, 7, 1, 4, 2, 5, 3, 6)
    return hidden.flatten(6, 7).flatten(4, 5).flatten(2, 3)


# -- the released layout ------------------------------------------------------------------------------------

# diffusers' names -> the reference's Wan names, per block and at the top
_BLOCK = {"attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
          "attn1.to_out.0": "self_attn.o", "attn1.norm_q": "self_attn.norm_q", "attn1.norm_k": "self_attn.norm_k",
          "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k", "attn2.to_v": "cross_attn.v",
          "attn2.to_out.0": "cross_attn.o", "attn2.norm_q": "cross_attn.norm_q", "attn2.norm_k": "cross_attn.norm_k",
          "attn2.add_k_proj": "cross_attn.k_img", "attn2.add_v_proj": "cross_attn.v_img",
          "attn2.norm_added_k": "cross_attn.norm_k_img", "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2",
          "norm2": "norm3", "scale_shift_table": "modulation"}
_TOP = {"patch_embedding": "patch_embedding",
        "condition_embedder.text_embedder.linear_1": "text_embedding.0",
        "condition_embedder.text_embedder.linear_2": "text_embedding.2",
        "condition_embedder.time_embedder.linear_1": "time_embedding.0",
        "condition_embedder.time_embedder.linear_2": "time_embedding.2",
        "condition_embedder.time_proj": "time_projection.1",
        "condition_embedder.image_embedder.norm1": "img_emb.proj.0",
        "condition_embedder.image_embedder.ff.net.0.proj": "img_emb.proj.1",
        "condition_embedder.image_embedder.ff.net.2": "img_emb.proj.3",
        "condition_embedder.image_embedder.norm2": "img_emb.proj.4"}


def _rename_block(rest: str, table: dict[str, str]) -> str:
    """A name inside a block ("attn1.to_q.weight", "scale_shift_table") through a module-name table."""
    if rest in table:  # a parameter of the block itself
        return table[rest]
    module, _, leaf = rest.rpartition(".")
    return f"{table[module]}.{leaf}"


def released_name(key: str) -> str:
    """A `WanVAPModel` key in the released file's names (the inverse of `vap_from_released`, blocks numbered as
    the branch's; `mot_layers` maps them to the DiT's)."""
    if key.startswith("blocks."):
        _, block, rest = key.split(".", 2)
        name = _rename_block(rest, {v: k for k, v in _BLOCK.items()})
        first, dot, tail = name.partition(".")
        return f"blocks.{block}.{first}{MOT}{dot}{tail}"
    module, _, leaf = key.rpartition(".")
    first, dot, tail = {v: k for k, v in _TOP.items()}[module].partition(".")
    return f"{first}{MOT}{dot}{tail}.{leaf}"


def _mot_layers_of(keys) -> list[int]:
    return sorted({int(k.split(".")[1]) for k in keys if k.startswith("blocks.") and MOT in k.split(".")[2]})


def vap_from_released(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The released file's `_mot_ref` tensors -> `WanVAPModel`'s (the reference's MotWanModel names, the branch's
    blocks numbered 0.. in the order of the DiT blocks that have one). The DiT's own tensors are left out."""
    layers = {block: n for n, block in enumerate(_mot_layers_of(state))}
    out = {}
    for key, value in state.items():
        if MOT not in key or "norm_added_q" in key:  # diffusers' older attention had an unused norm_added_q
            continue
        name = key.replace(MOT, "")
        module, _, leaf = name.rpartition(".")
        if name.startswith("blocks."):
            _, block, rest = name.split(".", 2)
            out[f"blocks.{layers[int(block)]}.{_rename_block(rest, _BLOCK)}"] = value
        elif name == "scale_shift_table" or module.startswith(("norm_out", "proj_out")):
            continue  # the branch's own output head ("reference_independent" training): not used
        elif module in _TOP:
            out[f"{_TOP[module]}.{leaf}"] = value
        else:
            raise KeyError(key)
    return out


def dit_from_released(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The released file without its `_mot_ref` tensors: the Wan I2V DiT in diffusers' names."""
    return {k: v for k, v in state.items() if MOT not in k and "norm_added_q" not in k}


def infer_vap_config(shapes: dict[str, tuple[int, ...]], heads: int | None = None) -> dict | None:
    """The branch's config from its (converted) shapes; its heads from the DiT's config where known (they do not
    show in shapes), else Wan's 128-channel heads."""
    try:
        dim, in_dim = shapes["patch_embedding.weight"][:2]
        count = 1 + max(int(k.split(".")[1]) for k in shapes if k.startswith("blocks."))
        image = "img_emb.proj.1.weight" in shapes
        return dict(VAP_14B_CONFIG, dim=dim, in_dim=in_dim, num_heads=heads or max(1, dim // 128),
                    ffn_dim=shapes["blocks.0.ffn.0.weight"][0], freq_dim=shapes["time_embedding.0.weight"][1],
                    text_dim=shapes["text_embedding.0.weight"][1], has_image_input=image,
                    image_dim=shapes["img_emb.proj.1.weight"][1] if image else VAP_14B_CONFIG["image_dim"],
                    mot_layers=VAP_MOT_LAYERS[:count] if count <= len(VAP_MOT_LAYERS) else list(range(count)))
    except (KeyError, IndexError, ValueError):
        return None


VAP_14B_CONFIG = {"_class_name": "WanVAPModel", "mot_layers": VAP_MOT_LAYERS, "patch_size": [1, 2, 2],
                  "has_image_input": True, "dim": 5120, "num_heads": 40, "ffn_dim": 13824, "freq_dim": 256,
                  "text_dim": 4096, "in_dim": 36, "image_dim": 1280, "eps": 1e-6}

VAP_DIT = ComponentSpec(
    name="dit", library=__name__, class_name="WanTransformer3DMOTModel",
    known_configs={"Video-As-Prompt-Wan2.1-14B (Wan2.1-I2V-14B)": dict(
        WAN_DIT_CONFIGS["Wan2.1-I2V-14B"], _class_name="WanTransformer3DMOTModel")},
    marker_keys=("patch_embedding_mot_ref.weight", "condition_embedder.time_proj.weight"),
    convert_state_dict=dit_from_released,
    description="Video-As-Prompt's Wan2.1 I2V DiT (ByteDance/Video-As-Prompt-Wan2.1-14B transformer/)")

VAP = ComponentSpec(
    name="vap", library=__name__, class_name="WanVAPModel",
    known_configs={"Video-As-Prompt-Wan2.1-14B": VAP_14B_CONFIG},
    marker_keys=("patch_embedding_mot_ref.weight", "blocks.0.attn1_mot_ref.to_q.weight"),
    convert_state_dict=vap_from_released, infer_config=infer_vap_config, companion=True,
    description="Video-As-Prompt branch (the _mot_ref tensors of ByteDance/Video-As-Prompt-Wan2.1-14B transformer/)")


# -- units -------------------------------------------------------------------------------------------------

class WanVAPPromptEmbedder(PipelineUnit):
    """`vap_prompt` (the reference clip's description; "" when none, as the reference trains) -> UMT5 embeddings
    (`context_vap`), with its negative for guidance."""

    feature = FEATURE
    cfg_inputs = {"vap_prompt": ("vap_prompt", "negative_vap_prompt")}
    cfg_outputs = {"context_vap": ("context_vap", "negative_context_vap")}
    models = ("text_encoder",)

    def process(self, pipe, vap_prompt):
        from diffusers.pipelines.wan.pipeline_wan import prompt_clean

        if getattr(pipe, "tokenizer", None) is None:
            raise UserError("no UMT5 tokenizer: pass --tokenizer_path (or tokenizer_config) to encode prompts")
        prompts = [vap_prompt or ""] if vap_prompt is None or isinstance(vap_prompt, str) else \
            ["" if p is None else p for p in vap_prompt]
        tokens = pipe.tokenizer([prompt_clean(p) for p in prompts], padding="max_length",
                                max_length=MAX_PROMPT_TOKENS, truncation=True, add_special_tokens=True,
                                return_attention_mask=True, return_tensors="pt")
        ids, mask = tokens.input_ids.to(pipe.device), tokens.attention_mask.to(pipe.device)
        hidden = pipe.text_encoder(ids, mask).last_hidden_state
        keep = torch.arange(hidden.shape[1], device=hidden.device)[None] < mask.sum(1, keepdim=True)
        return {"context_vap": (hidden * keep[..., None]).to(pipe.torch_dtype)}


class WanVAPVideoEmbedder(PipelineUnit):
    """`vap_video` -> the branch's input: its VAE latents and the I2V condition of its first frame (4-channel
    mask + latents of the first frame, then black; its last frame too when an end image is given), 36 channels;
    and its first frame's CLIP embedding."""

    feature = FEATURE
    inputs = ("vap_video", "end_image", "num_frames", "height", "width", "batch_size")
    outputs = ("vap_hidden_state", "vap_clip_feature")
    models = ("vae", "image_encoder")

    def process(self, pipe, vap_video, end_image, num_frames, height, width, batch_size):
        from .units import WanImageEmbedderCLIP, WanImageEmbedderVAE

        if vap_video is None:
            return {}
        n = int(batch_size or 1)
        clips = vap_video if n > 1 and isinstance(vap_video, (list, tuple)) and len(vap_video) == n and \
            not hasattr(vap_video[0], "size") else [vap_video] * n
        hidden, clip = [], []
        for frames, end in zip(clips, _per_sample(end_image, n)):
            frames = frames_of(frames)
            latents = vae_encode(pipe, video_tensor(frames, height, width))
            last = frames[-1] if end is not None else None
            condition = WanImageEmbedderVAE().process(pipe, frames[0], last, num_frames, height, width, 1)
            if "condition" not in condition:
                raise UserError("Video-As-Prompt needs Wan2.1's VAE (16 channels)")
            hidden.append(torch.cat([latents.to(pipe.torch_dtype), condition["condition"]], dim=1))
            embeds = WanImageEmbedderCLIP().process(pipe, frames[0], None, height, width, 1)
            if "image_embeds" not in embeds:
                raise UserError("Video-As-Prompt needs the CLIP image encoder (models_clip_...pth)")
            clip.append(embeds["image_embeds"])
        return {"vap_hidden_state": torch.cat(hidden), "vap_clip_feature": torch.cat(clip)}


VAP_FEATURE = Feature(name=FEATURE, columns=("vap_video",), models=("vap",),
                      model_fn_inputs=("vap_hidden_state", "vap_clip_feature", "context_vap"),
                      data_inputs=("vap_video", "vap_prompt"),
                      description="Video-As-Prompt: a reference clip through the mixture-of-transformers branch")
VAP_UNITS = (WanVAPPromptEmbedder, WanVAPVideoEmbedder)


class WanVAPPipeline(WanVariantPipeline):
    """Video-As-Prompt: Wan2.1 I2V-14B (conditioned on input_image as usual) with the `vap` branch reading a reference
    clip (`model_fn_wan_vap`). Its runs: the branch, its DiT file, or a vap_video column."""

    model_names = (*WanVariantPipeline.model_names, "vap")
    loss_models = ("dit", "vap")
    features = (I2V, CLIP, VAP_FEATURE)
    own_inputs = ("vap_video", "vap_prompt", "negative_vap_prompt")

    def __init__(self, device="cpu", torch_dtype=torch.float32, scheduler=None):
        super().__init__(device, torch_dtype, scheduler)
        self.units = [WanShapeChecker(), WanNoiseInitializer(), WanInputVideoEmbedder(), WanPromptEmbedder(),
                      WanImageEmbedderCLIP(), WanImageEmbedderVAE(), *(cls() for cls in VAP_UNITS)]

    @classmethod
    def claims(cls, context) -> bool:
        return context.config("vap") is not None or dit_class(context) == "WanTransformer3DMOTModel" \
            or context.has("vap_video")

    @classmethod
    def check_run(cls, context, features):
        super().check_run(context, features)
        if FEATURE not in features:
            raise UserError("Video-As-Prompt needs its reference clip: --extra_inputs vap_video (and the branch, "
                            "the transformer/ files of ByteDance/Video-As-Prompt-Wan2.1-14B)")

    def denoise(self, values, cfg_scale=1.0, progress=True, settings=None):
        # no negative reference-clip prompt (validation's renders): the positive one, as the reference's defaults
        # (" " for both) give
        if values.get("negative_context_vap") is None:
            values["negative_context_vap"] = values.get("context_vap")
        return super().denoise(values, cfg_scale=cfg_scale, progress=progress, settings=settings)

    def model_fn(self, latents, timestep, prompt_embeds, image_embeds=None, condition=None, first_frame_latents=None,
                 end_image_embeds=None, vap_hidden_state=None, vap_clip_feature=None, context_vap=None, **settings):
        settings.pop("expert_boundary", None)
        return model_fn_wan_vap(self.dit, self.vap, latents, timestep, prompt_embeds, image_embeds, condition,
                                vap_hidden_state, vap_clip_feature, context_vap, **settings)


__all__ = ["WanVAPPipeline", "FEATURE", "VAP", "VAP_14B_CONFIG", "VAP_DIT", "VAP_FEATURE", "VAP_UNITS",
           "WanTransformer3DMOTModel", "WanVAPModel", "WanVAPPromptEmbedder", "WanVAPVideoEmbedder",
           "dit_from_released", "infer_vap_config", "model_fn_wan_vap", "vap_from_released"]
