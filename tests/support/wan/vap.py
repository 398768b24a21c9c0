"""A tiny ByteDance/Video-As-Prompt-Wan2.1-14B in the released layout: `transformer/diffusion_pytorch_model.safetensors`
holding a tiny Wan2.1 I2V DiT (diffusers' names) and its Video-As-Prompt branch (`_mot_ref` names) beside a
config.json of class WanTransformer3DMOTModel; the UMT5 / VAE / CLIP .pth files in `Wan-AI/Wan2.1-I2V-14B-720P/`."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

import torch

from .common import TEXT_DIM, randomise, wan_common_files

TRANSFORMER_FOLDER = "ByteDance/Video-As-Prompt-Wan2.1-14B/transformer"
WAN_FOLDER = "Wan-AI/Wan2.1-I2V-14B-720P"
MOT_LAYERS = [0]  # of the tiny DiT's two blocks: one joint, one plain
# Wan's 128-channel heads (one head), as the released 5120 / 40: the branch's heads do not show in its shapes
SPEC = dict(num_attention_heads=1, attention_head_dim=128)


def tiny_vap_dit(seed: int = 31):
    from .tiny import TinyWanSpec, _transformer

    return randomise(_transformer("i2v", TinyWanSpec(**SPEC), seed), seed)


def tiny_vap_branch(seed: int = 32, mot_layers=tuple(MOT_LAYERS)):
    from .tiny import TinyWanSpec
    from difftune.families.wan.vap.model import WanVAPModel

    spec = TinyWanSpec(**SPEC)
    torch.manual_seed(seed)
    vap = WanVAPModel(mot_layers=list(mot_layers), dim=spec.num_attention_heads * spec.attention_head_dim,
                      num_heads=spec.num_attention_heads, ffn_dim=spec.ffn_dim, freq_dim=16, text_dim=TEXT_DIM,
                      in_dim=36, image_dim=spec.clip_hidden)
    return randomise(vap, seed)


def write_tiny_vap(models: str | os.PathLike, seed: int = 31) -> Path:
    """Under `models` (the hub base path): the VAP transformer folder and the Wan2.1 I2V files."""
    from safetensors.torch import save_file

    from difftune.families.wan.vap.keys import released_name

    models = Path(models)
    folder = models / TRANSFORMER_FOLDER
    folder.mkdir(parents=True, exist_ok=True)
    dit, vap = tiny_vap_dit(seed), tiny_vap_branch(seed + 1)
    state = {k: v.contiguous() for k, v in dit.state_dict().items()}
    for key, value in vap.state_dict().items():
        module, _, leaf = key.rpartition(".")
        if module.startswith("blocks."):  # the branch's block m sits in DiT block MOT_LAYERS[m]
            _, block, rest = key.split(".", 2)
            key = f"blocks.{MOT_LAYERS[int(block)]}.{rest}"
        state[released_name(key)] = value.contiguous()
    save_file(state, str(folder / "diffusion_pytorch_model.safetensors"))
    with tempfile.TemporaryDirectory() as tmp:
        dit.save_config(tmp)
        config = json.loads((Path(tmp) / "config.json").read_text())
    config.update(_class_name="WanTransformer3DMOTModel", block_idx_with_mot_ref=MOT_LAYERS,
                  attention_head_dim_mot_ref=None, reference_train_mode=None)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    wan_common_files(models / WAN_FOLDER, clip=True)
    return models


__all__ = ["MOT_LAYERS", "TRANSFORMER_FOLDER", "WAN_FOLDER", "tiny_vap_branch", "tiny_vap_dit", "write_tiny_vap"]
