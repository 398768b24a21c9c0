"""Krea-2 LoRA files in Krea's original module names (`blocks.N.attn.wq`, `first`, `txtfusion.projector`, ...):
read into diffusers' names, and written in them for the ComfyUI / kohya layouts.

Who writes which: Krea's trainer and ComfyUI key LoRAs to the original names behind `diffusion_model.`; the
reference saves its own (`blocks.0.attn.wq.lora_A.default.weight`), or with `--align_to_opensource_format`
diffusers' names behind `transformer.` (no alpha), which is difftune's default file. The renames are diffusers'
single-file converter's, applied to module paths.
"""

from __future__ import annotations

import re

import torch

from .components import convert_original_dit, original_dit_keys

_ORIGINAL_HEADS = ("blocks.", "first", "tmlp.", "tproj.", "txtmlp.", "txtfusion.", "last.")
_KEY = re.compile(r"^(?P<path>.+?)\.(?P<kind>lora_A|lora_B|lora_down|lora_up)(?:\.default)?\.weight$|"
                  r"^(?P<apath>.+)\.alpha$")
_PREFIXES = ("diffusion_model.", "base_model.model.", "transformer.", "model.diffusion_model.")


def _strip(path: str) -> str:
    for prefix in _PREFIXES:
        if path.startswith(prefix):
            return path[len(prefix):]
    return path


def to_diffusers_path(path: str) -> str:
    """An original module path -> diffusers' (`blocks.3.attn.wq` -> `transformer_blocks.3.attn.to_q`)."""
    return next(iter(convert_original_dit({path + ".weight": torch.empty(0)}))).removesuffix(".weight")


def to_original_path(path: str) -> str:
    return next(iter(original_dit_keys({path + ".weight": torch.empty(0)}))).removesuffix(".weight")


def convert_original_krea2_lora(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """A Krea-2 LoRA in the original names (any of `diffusion_model.`, `base_model.model.`, none; peft's
    `.default.` tag) -> diffusers' layout (`transformer.<path>.lora_A/B.weight`, alphas kept); None when the file
    does not use the original names."""
    parsed = []
    for key in state:
        m = _KEY.match(key)
        if m is None:
            return None
        path = _strip(m["path"] or m["apath"])
        parsed.append((key, path, m["kind"] or "alpha"))
    if not parsed or not all(p.startswith(_ORIGINAL_HEADS) for _, p, _ in parsed):
        return None
    names = {"lora_A": "lora_A.weight", "lora_down": "lora_A.weight", "lora_B": "lora_B.weight",
             "lora_up": "lora_B.weight", "alpha": "alpha"}
    return {f"transformer.{to_diffusers_path(path)}.{names[kind]}": state[key] for key, path, kind in parsed}


def krea2_lora_native_names(sd: dict[str, torch.Tensor], alphas: dict[str, float]
                            ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The DiT's LoRA (diffusers paths) in the original names, for the ComfyUI / kohya layouts: one module each."""
    out = {}
    for key, value in sd.items():
        path, _, tail = key.partition(".lora_")
        out[f"{to_original_path(path)}.lora_{tail}"] = value
    return out, {to_original_path(p): a for p, a in alphas.items()}


__all__ = ["convert_original_krea2_lora", "krea2_lora_native_names", "to_diffusers_path", "to_original_path"]
