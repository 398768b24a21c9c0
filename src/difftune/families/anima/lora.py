"""Anima's LoRA files in the released model's names (MiniTrainDIT's `blocks.N.self_attn.q_proj`, the adapter's
`llm_adapter.blocks.N.cross_attn.k_proj`): what ComfyUI, the reference's loader and diffusers' Anima loader (its
`_convert_non_diffusers_anima_lora_to_diffusers`, for keys behind `diffusion_model.`) read."""

from __future__ import annotations

import torch

from .components import original_name


def original_names(sd: dict[str, torch.Tensor], alphas: dict[str, float]) -> tuple[dict, dict]:
    """The DiT's LoRA (`<AnimaTransformer path>.lora_A/B.weight`, alpha per path) under the released names."""
    out = {}
    for key, value in sd.items():
        path, _, end = key.rpartition(".lora_")
        out[f"{original_name(path)}.lora_{end}"] = value
    return out, {original_name(p): a for p, a in alphas.items()}


def from_original_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """A LoRA in the released names behind `diffusion_model.` (ComfyUI's layout: this family's default file, the
    community's Anima LoRAs) -> the same under `AnimaTransformer`'s paths, by diffusers' own Anima converter (whose
    `transformer.` / `text_conditioner.` are this DiT's two parts); None for another layout."""
    from diffusers.loaders.lora_conversion_utils import _convert_non_diffusers_anima_lora_to_diffusers

    if not any(k.startswith(("diffusion_model.blocks.", "diffusion_model.llm_adapter.")) for k in state):
        return None
    return {(f"diffusion_model.{k}" if k.startswith(("transformer.", "text_conditioner.")) else k): v
            for k, v in _convert_non_diffusers_anima_lora_to_diffusers(dict(state)).items()}
