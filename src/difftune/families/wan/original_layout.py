"""Wan-AI's original files onto the transformers classes the Wan family runs.

The original repositories (Wan-AI/Wan2.1-T2V-1.3B, ...) ship the text encoder as
`models_t5_umt5-xxl-enc-bf16.pth` (Wan's own T5 module) and the I2V image encoder as
`models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth` (open-clip's XLM-RoBERTa CLIP: a text tower and
a ViT-H/14 vision tower). These are the key maps onto transformers' `UMT5EncoderModel` and
`CLIPVisionModelWithProjection`. (The DiT and the VAE go through diffusers' own single-file converters.)

The maths agree: Wan's T5 is UMT5 (a relative-position bias in every layer, unscaled attention, gated
tanh-GELU feed-forward: gate = wi_0, fc1 = wi_1); its CLIP vision tower is a pre-norm ViT with exact GELU
whose image feature is the output of the penultimate block, transformers' `hidden_states[-2]`.
"""

from __future__ import annotations

import re

import torch

from ...errors import UserError

# Wan T5 block tensor -> UMT5EncoderModel's, under encoder.block.<i>.
_T5_BLOCK = {
    "norm1.weight": "layer.0.layer_norm.weight",
    "attn.q.weight": "layer.0.SelfAttention.q.weight",
    "attn.k.weight": "layer.0.SelfAttention.k.weight",
    "attn.v.weight": "layer.0.SelfAttention.v.weight",
    "attn.o.weight": "layer.0.SelfAttention.o.weight",
    "pos_embedding.embedding.weight": "layer.0.SelfAttention.relative_attention_bias.weight",
    "norm2.weight": "layer.1.layer_norm.weight",
    "ffn.gate.0.weight": "layer.1.DenseReluDense.wi_0.weight",
    "ffn.fc1.weight": "layer.1.DenseReluDense.wi_1.weight",
    "ffn.fc2.weight": "layer.1.DenseReluDense.wo.weight",
}
T5_MARKERS = ("token_embedding.weight", "blocks.0.attn.q.weight", "blocks.0.ffn.gate.0.weight")


def _unknown(what: str, key: str) -> UserError:
    return UserError(f"{what}: tensor {key!r} has no place in the model (not the layout this converter knows)")


def umt5_from_wan(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        if key == "token_embedding.weight":
            out["shared.weight"] = value
            out["encoder.embed_tokens.weight"] = value
        elif key == "norm.weight":
            out["encoder.final_layer_norm.weight"] = value
        elif (m := re.fullmatch(r"blocks\.(\d+)\.(.+)", key)) and m.group(2) in _T5_BLOCK:
            out[f"encoder.block.{m.group(1)}.{_T5_BLOCK[m.group(2)]}"] = value
        else:
            raise _unknown("Wan T5 (umt5-xxl-enc)", key)
    return out


# open-clip ViT block tensor -> CLIPVisionModel's, under vision_model.encoder.layers.<i>.
_CLIP_BLOCK = {
    "norm1": "layer_norm1", "norm2": "layer_norm2", "attn.proj": "self_attn.out_proj",
    "mlp.0": "mlp.fc1", "mlp.2": "mlp.fc2",
}
CLIP_MARKERS = ("visual.patch_embedding.weight", "visual.cls_embedding", "visual.transformer.0.attn.to_qkv.weight")


def clip_vision_from_wan(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The vision tower of the open-clip XLM-RoBERTa ViT-H/14 file; its text tower (`textual.*`) and logit
    scale are not used by Wan and are left out."""
    out = {}
    for key, value in state.items():
        if not key.startswith("visual."):
            continue
        name = key[len("visual."):]
        if name == "patch_embedding.weight":
            out["vision_model.embeddings.patch_embedding.weight"] = value
        elif name == "cls_embedding":
            out["vision_model.embeddings.class_embedding"] = value.reshape(-1)
        elif name == "pos_embedding":
            out["vision_model.embeddings.position_embedding.weight"] = value.reshape(-1, value.shape[-1])
        elif name.startswith(("pre_norm.", "post_norm.")):
            norm, part = name.split(".")
            out[f"vision_model.{'pre_layrnorm' if norm == 'pre_norm' else 'post_layernorm'}.{part}"] = value
        elif name == "head":  # used as x @ head
            out["visual_projection.weight"] = value.t().contiguous()
        elif m := re.fullmatch(r"transformer\.(\d+)\.(.+)\.(weight|bias)", name):
            i, module, part = m.groups()
            prefix = f"vision_model.encoder.layers.{i}"
            if module == "attn.to_qkv":
                for proj, chunk in zip(("q_proj", "k_proj", "v_proj"), value.chunk(3, dim=0)):
                    out[f"{prefix}.self_attn.{proj}.{part}"] = chunk.contiguous()
            elif module in _CLIP_BLOCK:
                out[f"{prefix}.{_CLIP_BLOCK[module]}.{part}"] = value
            else:
                raise _unknown("Wan CLIP (open-clip xlm-roberta vit-huge-14)", key)
        else:
            raise _unknown("Wan CLIP (open-clip xlm-roberta vit-huge-14)", key)
    if not out:
        raise UserError("Wan CLIP file: no vision tower (`visual.*`) tensors")
    return out


# -- Wan2.2's VAE (Wan2.2_VAE.pth, TI2V-5B) -------------------------------------------------------------
# diffusers' single-file converter knows only Wan2.1's VAE. Wan2.2's keeps the same middle/head/conv names
# but nests each level: encoder.downsamples.<i>.downsamples.<j> holds the residual blocks and, last, the
# resample; the decoder likewise under upsamples.<i>.upsamples.<j>. Its shortcut averaging has no weights.
_RESIDUAL = {"residual.0.gamma": "norm1.gamma", "residual.2.weight": "conv1.weight", "residual.2.bias": "conv1.bias",
             "residual.3.gamma": "norm2.gamma", "residual.6.weight": "conv2.weight", "residual.6.bias": "conv2.bias",
             "shortcut.weight": "conv_shortcut.weight", "shortcut.bias": "conv_shortcut.bias"}
VAE22_MARKERS = ("encoder.downsamples.0.downsamples.0.residual.0.gamma", "decoder.upsamples.0.upsamples.0.residual.0.gamma")


def wan22_vae_from_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for key, value in state.items():
        new = None
        if m := re.fullmatch(r"(encoder|decoder)\.middle\.([02])\.(.+)", key):
            new = f"{m[1]}.mid_block.resnets.{int(m[2]) // 2}.{_RESIDUAL.get(m[3], '?')}"
        elif m := re.fullmatch(r"(encoder|decoder)\.middle\.1\.(.+)", key):
            new = f"{m[1]}.mid_block.attentions.0.{m[2]}"
        elif m := re.fullmatch(r"(encoder|decoder)\.head\.0\.gamma", key):
            new = f"{m[1]}.norm_out.gamma"
        elif m := re.fullmatch(r"(encoder|decoder)\.head\.2\.(weight|bias)", key):
            new = f"{m[1]}.conv_out.{m[2]}"
        elif m := re.fullmatch(r"(encoder|decoder)\.conv1\.(weight|bias)", key):
            new = f"{m[1]}.conv_in.{m[2]}"
        elif m := re.fullmatch(r"conv([12])\.(weight|bias)", key):
            new = f"{'quant_conv' if m[1] == '1' else 'post_quant_conv'}.{m[2]}"
        elif m := re.fullmatch(r"(encoder\.downsamples|decoder\.upsamples)\.(\d+)\.(?:down|up)samples\.(\d+)\.(.+)", key):
            side = "encoder.down_blocks" if m[1].startswith("encoder") else "decoder.up_blocks"
            if m[4] in _RESIDUAL:
                new = f"{side}.{m[2]}.resnets.{m[3]}.{_RESIDUAL[m[4]]}"
            elif m[4].startswith(("resample.", "time_conv.")):
                new = f"{side}.{m[2]}.{'downsampler' if side.startswith('encoder') else 'upsampler'}.{m[4]}"
        if new is None or "?" in new:
            raise _unknown("Wan2.2 VAE", key)
        out[new] = value
    return out
