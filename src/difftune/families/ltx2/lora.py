"""LTX-2 LoRA files in the official (Lightricks) module names, which the reference's DiT, ComfyUI's LTXAV model and
the official trainer use.

The default file is `diffusion_model.<official path>.lora_A/B.weight` with alpha / rank folded into B and no
`.alpha` tensors (the official trainer's layout), the one file all three readers take at the trained strength:
diffusers' `LTX2LoraLoaderMixin` converts `diffusion_model.` keys itself, the reference's GeneralLoRALoader drops a
leading `diffusion_model`, ComfyUI maps `diffusion_model.<path>` for every model (no alpha: scale 1). A `.alpha`
tensor (--lora_format comfyui) is refused by diffusers' check that every key names a LoRA; the diffusers layout's
`transformer.` prefix is read by diffusers alone.

The attention and feed-forward modules (the reference's targets) have the same paths in both namings; the
embeddings and AdaLN projections differ (`patchify_proj` / `proj_in`, `adaln_single` / `time_embed`, ...: the
DiT's segment table, `names.DIT_SEGMENTS`)."""

from __future__ import annotations

import re

import torch

from . import names as N

OFFICIAL_PREFIX = "diffusion_model."


def _flat_renamer(table: dict[str, str]):
    """Whole-segment renames in kohya's flat names (the module path's dots are underscores, then `.lora_down.weight`
    / `.alpha`): bounded by `_`, `.` or the ends, the longest name first so `audio_patchify_proj` is never read as
    `patchify_proj`."""
    words = sorted(table, key=len, reverse=True)
    pattern = re.compile(rf"(?:^|(?<=[._]))({'|'.join(map(re.escape, words))})(?=[._]|$)")
    return lambda text: pattern.sub(lambda m: table[m.group(1)], text)


_FLAT_TO_DIFFUSERS = _flat_renamer(N.DIT_SEGMENTS)


def _to_official(path: str) -> str:
    return N._segments(path, N._DIT_SEGMENTS_BACK)


def official_lora_names(sd: dict[str, torch.Tensor], alphas: dict[str, float]
                        ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A DiT LoRA on diffusers' module paths (`<path>.lora_A/B.weight`, alpha per path) on the official paths
    (--lora_format comfyui / kohya)."""
    out = {}
    for key, value in sd.items():
        path, _, rest = key.rpartition(".lora_")
        out[f"{_to_official(path)}.lora_{rest}"] = value
    return out, {_to_official(p): a for p, a in alphas.items()}


def reference_lora_names(sd: dict[str, torch.Tensor], alphas: dict[str, float]
                         ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """The default file's keys: the official paths under `diffusion_model.` (alpha already folded into B)."""
    renamed, alphas = official_lora_names(sd, alphas)
    return {OFFICIAL_PREFIX + k: v for k, v in renamed.items()}, alphas


def convert_official_lora(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """A LoRA file in the official names (`diffusion_model.`, bare, the reference's `.default`, kohya's
    `lora_unet_`) -> diffusers' module names; None when no key has a name of the official table (attention and
    feed-forward LoRAs read as they are)."""
    out, changed = {}, False
    for key, value in state.items():
        flat = key.startswith("lora_unet_")
        head, body = ("lora_unet_", key[len("lora_unet_"):]) if flat else ("", key)
        new = head + (_FLAT_TO_DIFFUSERS(body) if flat else N._segments(body, N.DIT_SEGMENTS))
        changed |= new != key
        out[new] = value
    return out if changed else None


__all__ = ["OFFICIAL_PREFIX", "convert_official_lora", "official_lora_names", "reference_lora_names"]
