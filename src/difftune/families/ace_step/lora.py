"""ACE-Step LoRA files in the original module names (`layers.N.self_attn.q_proj`, ...): read into diffusers' names,
and written in them for the reference's, ComfyUI's and kohya's layouts.

Who reads which: the reference's loader takes its own files (bare original paths, `layers.N...`, as its trainer
saves them); ComfyUI's ACE-Step 1.5 key map takes `diffusion_model.decoder.<path>` (its generic map of the model's
keys) or the official trainer's `base_model.model.<path>`; diffusers' `AceStepLoraLoaderMixin` takes diffusers'
layout and any file in the original names (it renames the attention projections). No one layout is read by all
three: the default file is diffusers' (docs/ace_step.md).
"""

from __future__ import annotations

import re

import torch

from .components import to_diffusers, to_original

_KEY = re.compile(r"^(?P<path>.+?)\.(?P<kind>lora_A|lora_B|lora_down|lora_up)(?:\.default)?\.weight$|"
                  r"^(?P<apath>.+)\.alpha$")
_PREFIXES = ("diffusion_model.decoder.", "base_model.model.", "diffusion_model.", "decoder.")
_ORIGINAL = re.compile(r"(^|\.)(self_attn|cross_attn)\.(q_proj|k_proj|v_proj|o_proj)$")
_NAMES = {"lora_A": "lora_A.weight", "lora_down": "lora_A.weight", "lora_B": "lora_B.weight",
          "lora_up": "lora_B.weight", "alpha": "alpha"}


# kohya's and LyCORIS's flattened original paths (`lora_unet_decoder_layers_0_self_attn_q_proj`, ComfyUI's
# `lycoris_layers_0_...`): the dots come back by the layers' module tree, as `_` is also inside its names
_FLAT_PREFIXES = ("lora_unet_decoder_", "lycoris_")
_FLAT = re.compile(r"^layers_(\d+)_(self_attn|cross_attn|mlp)_([a-z]+_proj)$")


def _unflatten(flat: str) -> str | None:
    m = _FLAT.match(flat)
    return None if m is None else f"layers.{m[1]}.{m[2]}.{m[3]}"


def _strip(path: str) -> tuple[str, bool]:
    for prefix in _FLAT_PREFIXES:
        if path.startswith(prefix):
            dotted = _unflatten(path[len(prefix):])
            return (dotted, True) if dotted is not None else (path, False)
    for prefix in _PREFIXES:
        if path.startswith(prefix):
            return path[len(prefix):], True
    return path, False


def convert_original_ace_step_lora(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """A LoRA in the original names (bare, `base_model.model.`, `diffusion_model.decoder.`, kohya's
    `lora_unet_decoder_<path with _>`, LyCORIS's `lycoris_<path with _>`; peft's `.default.` tag) -> diffusers'
    layout (`transformer.<path>.lora_A/B.weight`, alphas kept); None for another file."""
    parsed, original = [], False
    for key in state:
        m = _KEY.match(key)
        if m is None:
            return None
        path, prefixed = _strip(m["path"] or m["apath"])
        if not path.startswith("layers."):
            return None
        original = original or prefixed or bool(_ORIGINAL.search(path))
        parsed.append((key, path, m["kind"] or "alpha"))
    if not parsed or not original:
        return None
    return {f"transformer.{to_diffusers(path)}.{_NAMES[kind]}": state[key] for key, path, kind in parsed}


def _renamed(sd, alphas, head: str):
    out = {}
    for key, value in sd.items():
        path, _, tail = key.partition(".lora_")
        out[f"{head}{to_original(path)}.lora_{tail}"] = value
    return out, {f"{head}{to_original(p)}": a for p, a in alphas.items()}


def ace_step_lora_native_names(sd: dict[str, torch.Tensor], alphas: dict[str, float]):
    """The DiT's LoRA in the original file's module names (`decoder.layers.N.self_attn.q_proj`): ComfyUI's map of
    the model's keys (`diffusion_model.decoder.*`) and kohya's flattened names follow from them."""
    return _renamed(sd, alphas, "decoder.")


def ace_step_lora_reference_names(sd: dict[str, torch.Tensor], alphas: dict[str, float]):
    """... and in the reference's DiT's names (the original ones inside `decoder.`), as its trainer saves them."""
    return _renamed(sd, alphas, "")


__all__ = ["ace_step_lora_native_names", "ace_step_lora_reference_names", "convert_original_ace_step_lora"]
