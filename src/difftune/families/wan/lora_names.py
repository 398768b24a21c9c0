"""Wan LoRA module names: diffusers' (what difftune trains and saves by default) and Wan's original ones, which
ComfyUI and kohya-style trainers (musubi-tuner) use: `diffusion_model.blocks.0.self_attn.q` /
`lora_unet_blocks_0_self_attn_q`. Export renames onto the original names; import translates them back."""

from __future__ import annotations

import re

import torch

from ...errors import UserError

# diffusers' module (under blocks.<i>.) -> Wan's original one
_BLOCK = {
    "attn1.to_q": "self_attn.q", "attn1.to_k": "self_attn.k", "attn1.to_v": "self_attn.v",
    "attn1.to_out.0": "self_attn.o",
    "attn2.to_q": "cross_attn.q", "attn2.to_k": "cross_attn.k", "attn2.to_v": "cross_attn.v",
    "attn2.to_out.0": "cross_attn.o", "attn2.add_k_proj": "cross_attn.k_img", "attn2.add_v_proj": "cross_attn.v_img",
    "ffn.net.0.proj": "ffn.0", "ffn.net.2": "ffn.2",
}
_FROM_ORIGINAL = {v: k for k, v in _BLOCK.items()}
ORIGINAL_MODULE_NAMES = dict(_FROM_ORIGINAL)  # Wan's original module names (self_attn.q, ...) -> diffusers'

_FLAT = {v.replace(".", "_"): k for k, v in _BLOCK.items()}


def original_name(path: str) -> str:
    """blocks.3.attn1.to_q -> blocks.3.self_attn.q; a module with no original name is a one-line error."""
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", path)
    if m is None or m[2] not in _BLOCK:
        raise UserError(f"LoRA on {path}: the ComfyUI / kohya layouts name Wan's modules in its original names, and "
                        f"this one has none here (use --lora_format diffusers)")
    return f"blocks.{m[1]}.{_BLOCK[m[2]]}"


def module_in_diffusers(path: str) -> str:
    """blocks.3.self_attn.q (Wan's original module name) -> blocks.3.attn1.to_q; any other path unchanged."""
    m = re.fullmatch(r"blocks\.(\d+)\.(.+)", path)
    return f"blocks.{m[1]}.{_FROM_ORIGINAL[m[2]]}" if m is not None and m[2] in _FROM_ORIGINAL else path


def wan_native_names(sd: dict, alphas: dict) -> tuple[dict, dict]:
    """The DiT's LoRA (`<path>.lora_A/B.weight`, alpha per path) on Wan's original module names, for the ComfyUI /
    kohya layouts (`FamilySpec.lora_native_names`)."""
    names = {p: original_name(p) for p in alphas}
    renamed = {f"{names[k.rpartition('.lora_')[0]]}.lora_{k.rpartition('.lora_')[2]}": v for k, v in sd.items()}
    return renamed, {names[p]: a for p, a in alphas.items()}


_COMFY = re.compile(r"^(?:diffusion_model\.|model\.diffusion_model\.)?blocks\.(\d+)\.(.+?)\."
                    r"(lora_A\.weight|lora_B\.weight|lora_down\.weight|lora_up\.weight|alpha)$")
_KOHYA = re.compile(r"^lora_unet_blocks_(\d+)_(.+?)\.(lora_down\.weight|lora_up\.weight|alpha)$")
_SUFFIX = {"lora_A.weight": "lora_A.weight", "lora_down.weight": "lora_A.weight", "lora_B.weight": "lora_B.weight",
           "lora_up.weight": "lora_B.weight", "alpha": "alpha"}


def convert_original_wan_lora(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """A Wan LoRA in the original module names (ComfyUI `diffusion_model.blocks.N.self_attn.q.lora_A.weight`,
    musubi/kohya `lora_unet_blocks_N_self_attn_q.lora_down.weight`, with `.alpha`) in diffusers' layout
    (`transformer.blocks.N.attn1.to_q.lora_A.weight` + `.alpha`). None when the file is not in those names; a
    UserError for a key it cannot place (never a partial LoRA)."""
    if not any(re.search(r"(^|[._])(self_attn|cross_attn)[._]", k) or re.search(r"[._]ffn[._][02][._]", k)
               for k in state):
        return None
    out = {}
    for key, t in state.items():
        m = _COMFY.match(key)
        if m is not None:
            module = _FROM_ORIGINAL.get(m[2])
        else:
            m = _KOHYA.match(key)
            module = _FLAT.get(m[2]) if m is not None else None
        if m is None or module is None:
            raise UserError(f"{key}: not a key of a Wan DiT LoRA in Wan's original module names")
        out[f"transformer.blocks.{m[1]}.{module}.{_SUFFIX[m[3]]}"] = t
    return out
