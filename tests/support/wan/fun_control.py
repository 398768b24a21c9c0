"""Tiny Fun-Control / Control-Camera repositories as the reference's scripts name PAI's: one
`diffusion_pytorch_model.safetensors` in Wan's key names (ref_conv.*, control_adapter.* where the model has them)
with Wan's config.json, the UMT5 / VAE (/ CLIP for the Wan2.1 ones) .pth files and the tokenizer; the Wan2.2 A14B
ones with `high_noise_model/` and `low_noise_model/` and no CLIP."""

from __future__ import annotations

from pathlib import Path

import torch

from difftune.families.wan.dit_keys import dit_to_original
from difftune.families.wan.fun_control import FUN_DIT_ORIGINAL, WanFunTransformer3DModel
from .common import TINY, base_known_configs, save_tensors, tiny_dit_kwargs, write_base_repo, write_wan_config

# variant -> (input channels, CLIP image branch, ref_conv, camera adapter, A14B experts)
VARIANTS = {
    "control": (48, True, False, False, False),  # Wan2.1-Fun-{1.3B,14B}-Control
    "control_v11": (48, True, True, False, False),  # Wan2.1-Fun-V1.1-{1.3B,14B}-Control
    "camera": (32, True, False, True, False),  # Wan2.1-Fun-V1.1-{1.3B,14B}-Control-Camera
    "control_a14b": (52, False, True, False, True),  # Wan2.2-Fun-A14B-Control
    "camera_a14b": (36, False, False, True, True),  # Wan2.2-Fun-A14B-Control-Camera
}


def tiny_fun_transformer(variant: str, seed: int = 0) -> WanFunTransformer3DModel:
    in_channels, image, ref_conv, camera, _ = VARIANTS[variant]
    torch.manual_seed(seed)
    return WanFunTransformer3DModel(**tiny_dit_kwargs(2, in_channels, image=image),
                                    ref_conv_channels=16 if ref_conv else None,
                                    control_adapter_in_channels=24 if camera else None).eval()


def write_tiny_fun_original(path, variant: str = "control") -> tuple[Path, list[tuple]]:
    """A tiny Fun repository in PAI's released layout; returns its folder and the (spec, label, config) the tests
    add to the official configs."""
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {sorted(VARIANTS)}")
    _, image, _, _, experts = VARIANTS[variant]
    root, twin = write_base_repo(Path(path), "i2v" if image else "t2v")
    folders = [root] if not experts else [root / "high_noise_model", root / "low_noise_model"]
    known = base_known_configs(twin)
    for i, folder in enumerate(folders):
        model = tiny_fun_transformer(variant, seed=TINY.seed + 30 + i)
        save_tensors(dit_to_original(model.state_dict()), folder / "diffusion_pytorch_model.safetensors")
        config = {k: v for k, v in model.config.items() if not k.startswith("_")}
        write_wan_config(folder, "WanModel", config, model_type="i2v")
        if i == 0:
            known.append((FUN_DIT_ORIGINAL, "tiny", {"_class_name": "WanFunTransformer3DModel", **config}))
    return root, known


__all__ = ["VARIANTS", "tiny_fun_transformer", "write_tiny_fun_original"]
