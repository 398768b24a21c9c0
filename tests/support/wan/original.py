"""Wan-AI's ORIGINAL file layout for tiny models: the inverse of the converters the Wan family loads them with
(diffusers' single-file converters for the DiT and the Wan2.1 VAE; families/wan/original_layout.py for the
T5 and CLIP), so a tiny diffusers-layout model can be written as `diffusion_pytorch_model.safetensors`,
`models_t5_umt5-xxl-enc-bf16.pth`, `Wan2.1_VAE.pth`, `models_clip_open-clip-xlm-roberta-large-vit-huge-14.pth`.
Tests check each inverse by running the forward converter on its output.
"""

from __future__ import annotations

import re

import torch

# the DiT's map is the family's (a full DiT can be saved in Wan's names); tests import it from here too
from difftune.families.wan.dit_keys import dit_to_original as wan_dit_to_original  # noqa: E402,F401
from difftune.families.wan.original_layout import _RESIDUAL


# diffusers' residual-block tensor -> Wan's (the inverse of the family's map; both VAEs name them so)
_RESNET = {v: k for k, v in _RESIDUAL.items()}


def wan_vae_to_original(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Wan2.1's VAE (4 levels, 2 residual blocks per level: the layout diffusers' converter assumes)."""
    out = {}
    for key, value in state.items():
        new = None
        if m := re.fullmatch(r"(encoder|decoder)\.mid_block\.resnets\.(\d)\.(.+)", key):
            new = f"{m[1]}.middle.{2 * int(m[2])}.{_RESNET[m[3]]}"
        elif m := re.fullmatch(r"(encoder|decoder)\.mid_block\.attentions\.0\.(.+)", key):
            new = f"{m[1]}.middle.1.{m[2]}"
        elif m := re.fullmatch(r"(encoder|decoder)\.norm_out\.gamma", key):
            new = f"{m[1]}.head.0.gamma"
        elif m := re.fullmatch(r"(encoder|decoder)\.conv_out\.(weight|bias)", key):
            new = f"{m[1]}.head.2.{m[2]}"
        elif m := re.fullmatch(r"(encoder|decoder)\.conv_in\.(weight|bias)", key):
            new = f"{m[1]}.conv1.{m[2]}"
        elif m := re.fullmatch(r"(post_)?quant_conv\.(weight|bias)", key):
            new = f"{'conv2' if m[1] else 'conv1'}.{m[2]}"
        elif m := re.fullmatch(r"encoder\.down_blocks\.(\d+)\.(.+)", key):
            new = f"encoder.downsamples.{m[1]}.{_RESNET.get(m[2], m[2])}"
        elif m := re.fullmatch(r"decoder\.up_blocks\.(\d)\.resnets\.(\d)\.(.+)", key):
            new = f"decoder.upsamples.{4 * int(m[1]) + int(m[2])}.{_RESNET[m[3]]}"
        elif m := re.fullmatch(r"decoder\.up_blocks\.(\d)\.upsamplers\.0\.(.+)", key):
            new = f"decoder.upsamples.{4 * int(m[1]) + 3}.{m[2]}"
        if new is None:
            raise KeyError(f"no original name for the Wan VAE tensor {key}")
        out[new] = value
    return out


def umt5_to_wan(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    from difftune.families.wan.original_layout import _T5_BLOCK

    inverse = {v: k for k, v in _T5_BLOCK.items()}
    out = {}
    for key, value in state.items():
        if key == "shared.weight":
            out["token_embedding.weight"] = value
        elif key == "encoder.final_layer_norm.weight":
            out["norm.weight"] = value
        elif m := re.fullmatch(r"encoder\.block\.(\d+)\.(.+)", key):
            out[f"blocks.{m[1]}.{inverse[m[2]]}"] = value
    return out


_CLIP_BLOCK_INV = {"layer_norm1": "norm1", "layer_norm2": "norm2", "self_attn.out_proj": "attn.proj",
                   "mlp.fc1": "mlp.0", "mlp.fc2": "mlp.2"}


def clip_vision_to_wan(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A CLIPVisionModelWithProjection's tensors in open-clip's `visual.*` names (no text tower)."""
    out = {}
    qkv: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        if key == "vision_model.embeddings.patch_embedding.weight":
            out["visual.patch_embedding.weight"] = value
        elif key == "vision_model.embeddings.class_embedding":
            out["visual.cls_embedding"] = value.reshape(1, 1, -1)
        elif key == "vision_model.embeddings.position_embedding.weight":
            out["visual.pos_embedding"] = value.unsqueeze(0)
        elif m := re.fullmatch(r"vision_model\.(pre_layrnorm|post_layernorm)\.(weight|bias)", key):
            out[f"visual.{'pre_norm' if m[1] == 'pre_layrnorm' else 'post_norm'}.{m[2]}"] = value
        elif key == "visual_projection.weight":
            out["visual.head"] = value.t().contiguous()
        elif m := re.fullmatch(r"vision_model\.encoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)", key):
            qkv.setdefault(f"visual.transformer.{m[1]}.attn.to_qkv.{m[3]}", {})[m[2]] = value
        elif m := re.fullmatch(r"vision_model\.encoder\.layers\.(\d+)\.(.+)\.(weight|bias)", key):
            out[f"visual.transformer.{m[1]}.{_CLIP_BLOCK_INV[m[2]]}.{m[3]}"] = value
    for key, parts in qkv.items():
        out[key] = torch.cat([parts["q"], parts["k"], parts["v"]], 0)
    return out


def wan22_vae_to_original(state: dict[str, torch.Tensor], num_res_blocks: int = 2) -> dict[str, torch.Tensor]:
    """Wan2.2's VAE (TI2V-5B) in its original nested names."""
    out = {}
    for key, value in state.items():
        if m := re.fullmatch(r"encoder\.down_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", key):
            new = f"encoder.downsamples.{m[1]}.downsamples.{m[2]}.{_RESNET[m[3]]}"
        elif m := re.fullmatch(r"encoder\.down_blocks\.(\d+)\.downsampler\.(.+)", key):
            new = f"encoder.downsamples.{m[1]}.downsamples.{num_res_blocks}.{m[2]}"
        elif m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.resnets\.(\d+)\.(.+)", key):
            new = f"decoder.upsamples.{m[1]}.upsamples.{m[2]}.{_RESNET[m[3]]}"
        elif m := re.fullmatch(r"decoder\.up_blocks\.(\d+)\.upsampler\.(.+)", key):
            new = f"decoder.upsamples.{m[1]}.upsamples.{num_res_blocks + 1}.{m[2]}"
        else:  # middle, head, conv_in, quant convs: Wan2.1's names
            new = next(iter(wan_vae_to_original({key: value})))
        out[new] = value
    return out
