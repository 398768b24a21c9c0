"""Tiny VACE repositories as the reference's VACE scripts name them: Wan-AI/Wan2.1-VACE-1.3B, iic/VACE-Wan2.1-1.3B-
Preview and Wan-AI/Wan2.1-VACE-14B hold one `diffusion_pytorch_model.safetensors` (the T2V DiT and the VACE branch
in Wan's key names) with Wan's config.json (class VaceWanModel); PAI/Wan2.2-VACE-Fun-A14B one per expert in
`high_noise_model/` and `low_noise_model/`. UMT5, the VAE and the tokenizer as every Wan-AI repository has them."""

from __future__ import annotations

from pathlib import Path

import torch

from difftune.families.wan.dit_keys import dit_to_original
from difftune.families.wan.vace import VACE_DIT_ORIGINAL, VACE_ORIGINAL, vace_to_original
from .common import TINY, base_known_configs, save_tensors, tiny_dit_kwargs, write_base_repo, write_wan_config

VARIANTS = ("1.3b", "14b", "a14b")
TINY_LAYERS = 4
TINY_VACE_LAYERS = (0, 2)  # every second block, as the 1.3B's


def tiny_vace_transformer(seed: int = 0, num_layers: int = TINY_LAYERS, vace_layers=TINY_VACE_LAYERS):
    """diffusers' WanVACETransformer3DModel at the tiny size (the source of a tiny VACE file's tensors)."""
    return vace_transformer(tiny_dit_kwargs(num_layers), vace_layers, seed)


def vace_transformer(dit_config: dict, vace_layers, seed: int = 0):
    """diffusers' WanVACETransformer3DModel: a T2V DiT of `dit_config` (a WanTransformer3DModel config) with a VACE
    branch after the DiT blocks `vace_layers`."""
    from diffusers import WanVACETransformer3DModel

    torch.manual_seed(seed)
    dit = {k: v for k, v in dit_config.items() if not k.startswith("_")}
    return WanVACETransformer3DModel(**dit, vace_layers=list(vace_layers), vace_in_channels=96).eval()


def vace_file_state(model) -> dict[str, torch.Tensor]:
    """A WanVACETransformer3DModel's tensors in the released file's names (DiT and VACE branch in one file)."""
    state = model.state_dict()
    dit = dit_to_original({k: v for k, v in state.items() if not k.startswith("vace_")})
    vace = vace_to_original({k: v for k, v in state.items() if k.startswith("vace_")})
    return {**dit, **vace}


def tiny_vace_configs(model) -> tuple[dict, dict]:
    """(the DiT's WanTransformer3DModel config, the branch's WanVACEModel config) of a tiny VACE model."""
    c = dict(model.config)
    dit = {k: v for k, v in c.items() if not k.startswith("vace_") and not k.startswith("_")}
    dit["_class_name"] = "WanTransformer3DModel"
    vace = {"_class_name": "WanVACEModel", "vace_layers": list(c["vace_layers"]),
            "vace_in_channels": c["vace_in_channels"], "num_attention_heads": c["num_attention_heads"],
            "attention_head_dim": c["attention_head_dim"], "ffn_dim": c["ffn_dim"], "patch_size": list(c["patch_size"]),
            "cross_attn_norm": c["cross_attn_norm"], "qk_norm": c["qk_norm"], "eps": c["eps"],
            "added_kv_proj_dim": c["added_kv_proj_dim"]}
    return dit, vace


def write_vace_file(folder: Path, model) -> tuple[dict, dict]:
    """`model` (a WanVACETransformer3DModel) as a released VACE file in `folder`: one
    `diffusion_pytorch_model.safetensors` in Wan's names and Wan's config.json (VaceWanModel). Returns its (DiT,
    branch) configs: bare files are recognised against known configs, so a caller registers them."""
    save_tensors(vace_file_state(model), Path(folder) / "diffusion_pytorch_model.safetensors")
    dit, vace = tiny_vace_configs(model)
    write_wan_config(Path(folder), "VaceWanModel", dit, model_type="vace", vace_layers=vace["vace_layers"],
                     vace_in_dim=vace["vace_in_channels"])
    return dit, vace


def write_tiny_vace_original(path, variant: str = "1.3b") -> tuple[Path, list[tuple]]:
    """A tiny VACE repository in the released layout; returns its folder and the (spec, label, config) the tests
    add to the official configs to recognise its bare files (the DiT, the VACE branch, UMT5, the VAE)."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}")
    root, twin = write_base_repo(Path(path), "t2v")
    folders = [root] if variant != "a14b" else [root / "high_noise_model", root / "low_noise_model"]
    known = base_known_configs(twin)
    for i, folder in enumerate(folders):
        dit, vace = write_vace_file(folder, tiny_vace_transformer(seed=TINY.seed + 20 + i))
        if i == 0:
            known += [(VACE_DIT_ORIGINAL, "tiny", dit), (VACE_ORIGINAL, "tiny", vace)]
    return root, known


__all__ = ["TINY_VACE_LAYERS", "tiny_vace_configs", "tiny_vace_transformer", "vace_file_state", "vace_transformer",
           "write_tiny_vace_original", "write_vace_file"]
