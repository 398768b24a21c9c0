"""Single-file checkpoints in the original LDM / SGM layout, made from diffusers-layout models (test data: the
inverse of diffusers' single-file converters, which difftune's loaders run the other way): the UNet behind
`model.diffusion_model.`, the autoencoder behind `first_stage_model.`, CLIP-L behind its prefix and OpenCLIP bigG
(fused in_proj, resblocks) behind `conditioner.embedders.1.model.`."""

from __future__ import annotations

import re

import torch

from .flux.tiny import _ldm_vae_from_diffusers

STEP = 3  # an LDM level: its 2 layers and one down/upsampler
_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0", "conv2": "out_layers.3",
           "time_emb_proj": "emb_layers.1", "conv_shortcut": "skip_connection"}
_GLOBAL = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
           "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",
           "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2"}


def _resnet(rest: str) -> str:
    head, _, tail = rest.partition(".")
    return f"{_RESNET.get(head, head)}.{tail}"


def ldm_unet(state: dict) -> dict:
    """A diffusers UNet2DConditionModel state dict (2 layers per level) in the LDM names, behind its prefix."""
    attn_up = {int(m[1]) for k in state if (m := re.match(r"up_blocks\.(\d+)\.attentions\.", k))}
    out = {}
    for key, t in state.items():
        if m := re.match(r"down_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", key):
            k = f"input_blocks.{1 + int(m[1]) * STEP + int(m[2])}.0.{_resnet(m[3])}"
        elif m := re.match(r"down_blocks\.(\d+)\.attentions\.(\d+)\.(.*)", key):
            k = f"input_blocks.{1 + int(m[1]) * STEP + int(m[2])}.1.{m[3]}"
        elif m := re.match(r"down_blocks\.(\d+)\.downsamplers\.0\.conv\.(.*)", key):
            k = f"input_blocks.{(int(m[1]) + 1) * STEP}.0.op.{m[2]}"
        elif m := re.match(r"up_blocks\.(\d+)\.resnets\.(\d+)\.(.*)", key):
            k = f"output_blocks.{int(m[1]) * STEP + int(m[2])}.0.{_resnet(m[3])}"
        elif m := re.match(r"up_blocks\.(\d+)\.attentions\.(\d+)\.(.*)", key):
            k = f"output_blocks.{int(m[1]) * STEP + int(m[2])}.1.{m[3]}"
        elif m := re.match(r"up_blocks\.(\d+)\.upsamplers\.0\.(.*)", key):
            i = int(m[1])
            k = f"output_blocks.{i * STEP + 2}.{2 if i in attn_up else 1}.{m[2]}"
        elif m := re.match(r"mid_block\.resnets\.(\d+)\.(.*)", key):
            k = f"middle_block.{2 * int(m[1])}.{_resnet(m[2])}"
        elif key.startswith("mid_block.attentions.0."):
            k = "middle_block.1." + key[len("mid_block.attentions.0."):]
        else:
            head, _, param = key.rpartition(".")
            k = f"{_GLOBAL[head]}.{param}"
        out["model.diffusion_model." + k] = t
    return out


def ldm_vae(state: dict) -> dict:
    return {"first_stage_model." + k: v for k, v in _ldm_vae_from_diffusers(state, 4).items()}


def ldm_clip(state: dict, prefix: str) -> dict:
    """A CLIPTextModel's tensors (transformers 5 names, without `text_model.`) behind `prefix` in the released
    names (with it)."""
    return {f"{prefix}text_model.{k}" if not k.startswith("text_model.") else prefix + k: v for k, v in state.items()}


def open_clip(state: dict, prefix: str = "conditioner.embedders.1.model.") -> dict:
    """A CLIPTextModelWithProjection's tensors in OpenCLIP's names (q, k, v fused into in_proj; text_projection as
    (hidden, projection))."""
    out, fused = {}, {}
    for key, t in state.items():
        if key == "text_projection.weight":
            out[prefix + "text_projection"] = t.T.contiguous()
            continue
        k = key.removeprefix("text_model.")
        if k == "embeddings.token_embedding.weight":
            out[prefix + "token_embedding.weight"] = t
        elif k == "embeddings.position_embedding.weight":
            out[prefix + "positional_embedding"] = t
        elif k.startswith("final_layer_norm."):
            out[prefix + "ln_final." + k.split(".")[-1]] = t
        elif m := re.match(r"encoder\.layers\.(\d+)\.self_attn\.([qkv])_proj\.(weight|bias)", k):
            fused.setdefault((int(m[1]), m[3]), {})[m[2]] = t
        elif m := re.match(r"encoder\.layers\.(\d+)\.(.*)", k):
            rest = (m[2].replace("self_attn.", "attn.").replace("layer_norm1", "ln_1").replace("layer_norm2", "ln_2")
                    .replace("mlp.fc1", "mlp.c_fc").replace("mlp.fc2", "mlp.c_proj"))
            out[f"{prefix}transformer.resblocks.{m[1]}.{rest}"] = t
    for (layer, kind), parts in fused.items():
        out[f"{prefix}transformer.resblocks.{layer}.attn.in_proj_{kind}"] = torch.cat([parts[x] for x in "qkv"])
    return out


__all__ = ["ldm_clip", "ldm_unet", "ldm_vae", "open_clip"]
