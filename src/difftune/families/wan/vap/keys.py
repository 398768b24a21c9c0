"""Video-As-Prompt's released layout: one file holds the Wan I2V DiT (diffusers' names) and the branch under
`_mot_ref` names, converted to the reference's MotWanModel names (`vap_from_released`, `released_name`); the two
slots' configs and the recognition of the file."""

from __future__ import annotations

import torch

from ....models.detect import ComponentSpec
from ..components import WAN_DIT_CONFIGS
from .model import VAP_MOT_LAYERS, WanTransformer3DMOTModel, WanVAPModel

MOT = "_mot_ref"

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
    name="dit", library=WanTransformer3DMOTModel.__module__, class_name="WanTransformer3DMOTModel",
    known_configs={"Video-As-Prompt-Wan2.1-14B (Wan2.1-I2V-14B)": dict(
        WAN_DIT_CONFIGS["Wan2.1-I2V-14B"], _class_name="WanTransformer3DMOTModel")},
    marker_keys=("patch_embedding_mot_ref.weight", "condition_embedder.time_proj.weight"),
    convert_state_dict=dit_from_released,
    description="Video-As-Prompt's Wan2.1 I2V DiT (ByteDance/Video-As-Prompt-Wan2.1-14B transformer/)")

VAP = ComponentSpec(
    name="vap", library=WanVAPModel.__module__, class_name="WanVAPModel",
    known_configs={"Video-As-Prompt-Wan2.1-14B": VAP_14B_CONFIG},
    marker_keys=("patch_embedding_mot_ref.weight", "blocks.0.attn1_mot_ref.to_q.weight"),
    convert_state_dict=vap_from_released, infer_config=infer_vap_config, companion=True,
    description="Video-As-Prompt branch (the _mot_ref tensors of ByteDance/Video-As-Prompt-Wan2.1-14B transformer/)")


__all__ = ["MOT", "VAP", "VAP_14B_CONFIG", "VAP_DIT", "dit_from_released", "infer_vap_config", "released_name",
           "vap_from_released"]
