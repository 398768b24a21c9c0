"""SDXL's UNet in its original (LDM, Stability's `sgm`) module names, which kohya's SDXL LoRAs use
(`lora_unet_input_blocks_4_1_transformer_blocks_0_attn1_to_q`) and A1111 / Forge read: diffusers' paths to those
and back, block by block, for SDXL's layout (three levels of two layers; diffusers' own single-file converter maps
the same way for whole checkpoints)."""

from __future__ import annotations

import re

import torch

LAYERS = 2  # SDXL's layers_per_block: an LDM level is its layers and one down/upsampler
_RESNET = {"norm1": "in_layers.0", "conv1": "in_layers.2", "norm2": "out_layers.0", "conv2": "out_layers.3",
           "time_emb_proj": "emb_layers.1", "conv_shortcut": "skip_connection"}
_GLOBAL = {"time_embedding.linear_1": "time_embed.0", "time_embedding.linear_2": "time_embed.2",
           "add_embedding.linear_1": "label_emb.0.0", "add_embedding.linear_2": "label_emb.0.2",
           "conv_in": "input_blocks.0.0", "conv_norm_out": "out.0", "conv_out": "out.2"}


def _block(path: str) -> tuple[str, str] | None:
    """A diffusers module path -> (its LDM block prefix, the rest), or None."""
    step = LAYERS + 1
    patterns = (
        (r"down_blocks\.(\d+)\.resnets\.(\d+)", lambda i, j: f"input_blocks.{1 + i * step + j}.0", True),
        (r"down_blocks\.(\d+)\.attentions\.(\d+)", lambda i, j: f"input_blocks.{1 + i * step + j}.1", False),
        (r"down_blocks\.(\d+)\.downsamplers\.0", lambda i, _: f"input_blocks.{(i + 1) * step}.0", False),
        (r"up_blocks\.(\d+)\.resnets\.(\d+)", lambda i, j: f"output_blocks.{i * step + j}.0", True),
        (r"up_blocks\.(\d+)\.attentions\.(\d+)", lambda i, j: f"output_blocks.{i * step + j}.1", False),
        (r"up_blocks\.(\d+)\.upsamplers\.0", None, False),
        (r"mid_block\.attentions\.0", lambda *_: "middle_block.1", False),
        (r"mid_block\.resnets\.(\d+)", lambda j, _=0: f"middle_block.{2 * j}", True),
    )
    for pattern, name, resnet in patterns:
        m = re.match(pattern + r"(?:\.|$)", path)
        if m is None:
            continue
        rest = path[m.end():]
        if name is None:  # an upsampler follows the level's resnets (and attentions, where it has them)
            return None
        if resnet:
            head, _, tail = rest.partition(".")
            rest = ".".join(p for p in (_RESNET.get(head, head), tail) if p)
        if pattern.startswith(r"down_blocks\.(\d+)\.downsamplers"):
            rest = rest.replace("conv", "op", 1)
        return name(*(int(g) for g in m.groups())), rest
    for new, old in _GLOBAL.items():
        if path == new or path.startswith(new + "."):
            return old, path[len(new) + 1:]
    return None


def ldm_path(path: str) -> str:
    place = _block(path)
    if place is None:
        raise ValueError(f"{path}: no module of SDXL's original UNet layout holds this layer")
    return ".".join(p for p in place if p)


def ldm_names(sd: dict[str, torch.Tensor], alphas: dict[str, float]) -> tuple[dict, dict]:
    """The UNet's LoRA (`<diffusers path>.lora_A/B.weight`, alpha per path) under the LDM paths."""
    out, out_alphas = {}, {}
    for key, value in sd.items():
        path, _, end = key.rpartition(".lora_")
        out[f"{ldm_path(path)}.lora_{end}"] = value
    for path, alpha in alphas.items():
        out_alphas[ldm_path(path)] = alpha
    return out, out_alphas


def _diffusers_paths() -> dict[str, str]:
    """LDM block prefix (flattened, `_` for `.`) -> diffusers' path, over SDXL's blocks (and a deeper margin)."""
    step = LAYERS + 1
    table = {}
    for i in range(4):
        for j in range(LAYERS):
            table[f"input_blocks_{1 + i * step + j}_0"] = f"down_blocks.{i}.resnets.{j}"
            table[f"input_blocks_{1 + i * step + j}_1"] = f"down_blocks.{i}.attentions.{j}"
        for j in range(step):
            table[f"output_blocks_{i * step + j}_0"] = f"up_blocks.{i}.resnets.{j}"
            table[f"output_blocks_{i * step + j}_1"] = f"up_blocks.{i}.attentions.{j}"
    table["middle_block_1"] = "mid_block.attentions.0"
    table["middle_block_0"], table["middle_block_2"] = "mid_block.resnets.0", "mid_block.resnets.1"
    return table


_RESNET_FLAT = {v.replace(".", "_"): k for k, v in _RESNET.items()}


def kohya_from_ldm(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """A kohya SDXL LoRA in LDM names -> the same in diffusers' paths (`lora_unet_down_blocks_1_attentions_0_...`),
    which the kohya reader places against the model; None for a file without LDM names."""
    if not any(k.startswith(("lora_unet_input_blocks_", "lora_unet_output_blocks_", "lora_unet_middle_block_"))
               for k in state):
        return None
    table = _diffusers_paths()
    out = {}
    for key, value in state.items():
        if not key.startswith("lora_unet_"):
            out[key] = value
            continue
        flat, dot, end = key[len("lora_unet_"):].partition(".")
        m = re.match(r"((?:input_blocks|output_blocks)_\d+_\d|middle_block_\d)(?:_(.*))?$", flat)
        if m is None or m.group(1) not in table:
            out[key] = value
            continue
        rest = m.group(2) or ""
        if table[m.group(1)].split(".")[-2] == "resnets":
            for old, new in _RESNET_FLAT.items():
                if rest == old or rest.startswith(old + "_"):
                    rest = new + rest[len(old):]
                    break
        path = table[m.group(1)].replace(".", "_") + (f"_{rest}" if rest else "")
        out[f"lora_unet_{path}{dot}{end}"] = value
    return out


__all__ = ["kohya_from_ldm", "ldm_names", "ldm_path"]
