"""Anima's LoRA files in the released model's names (MiniTrainDIT's `blocks.N.self_attn.q_proj`, the adapter's
`llm_adapter.blocks.N.cross_attn.k_proj`): what ComfyUI, the reference's loader and diffusers' Anima loader (its
`_convert_non_diffusers_anima_lora_to_diffusers`, for keys behind `diffusion_model.`) read."""

from __future__ import annotations

import re

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


# kohya's flattened names (`lora_unet_blocks_0_self_attn_q_proj`, `lora_unet_llm_adapter_blocks_0_mlp_0`): the block
# modules' released names, dots put back
_KOHYA_BLOCK = re.compile(r"(llm_adapter_)?blocks_(\d+)_(self_attn|cross_attn|mlp|adaln_modulation_self_attn|"
                          r"adaln_modulation_cross_attn|adaln_modulation_mlp)_(.+)")


def _unflatten(flat: str) -> str | None:
    m = _KOHYA_BLOCK.fullmatch(flat)
    if m is None:
        return None
    return f"{'llm_adapter.' if m[1] else ''}blocks.{m[2]}.{m[3]}.{m[4]}"


def from_kohya_original_names(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """A kohya LoRA in the released names (`lora_unet_blocks_N_..._q_proj.lora_down/lora_up` + `.alpha`: what
    `--lora_format kohya` writes, and sd-scripts-style Anima LoRAs) -> ComfyUI's layout in those names, then as
    `from_original_names`; None for another layout. Modules outside the blocks are left as they are."""
    if not any(k.startswith(("lora_unet_blocks_", "lora_unet_llm_adapter_blocks_")) for k in state):
        return None
    out = {}
    for key, value in state.items():
        flat, dot, end = key.removeprefix("lora_unet_").partition(".")
        name = _unflatten(flat) if key.startswith("lora_unet_") else None
        if name is None:
            out[key] = value
            continue
        end = {"lora_down.weight": "lora_A.weight", "lora_up.weight": "lora_B.weight"}.get(end, end)
        out[f"diffusion_model.{name}{dot}{end}"] = value
    return from_original_names(out)
