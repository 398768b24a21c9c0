"""Ideogram-4 LoRA files in Ideogram's original module names (fused `attention.qkv`, `attention.o`):
`--lora_format comfyui`, which the reference's loader (its DiT has those modules) and ComfyUI (its Ideogram-4 model
keeps them, read through its generic `diffusion_model.<module>` map) read. diffusers' Ideogram4LoraLoaderMixin reads
them only while every module is in the blocks (its converter knows `layers.N.*` alone and refuses anything else, such
as the final layer's modulation the reference's `adaln_modulation` takes), hence the diffusers layout by default.

Writing: q, k and v's adapters become one on qkv, the downs stacked and the up block-diagonal (rank 3r), which
applies exactly the three updates. Reading: a fused qkv adapter becomes three with the same down and the up's
thirds (diffusers' reading), exact too.
"""

from __future__ import annotations

import re

import torch

_PARTS = ("to_q", "to_k", "to_v")
_SPLIT = re.compile(r"^(?P<head>.*?layers\.\d+\.attention\.)to_(?P<part>[qkv])$")
_FUSED_KEY = re.compile(r"^(?P<head>.*?layers\.\d+\.attention\.)qkv\.(?P<rest>(lora_A|lora_B|lora_down|lora_up)"
                        r"(\.[^.]+)?\.weight|alpha)$")
_OUT_KEY = re.compile(r"^(?P<head>.*?layers\.\d+\.attention\.)o\.(?P<rest>.+)$")


def original_lora_from_diffusers(sd: dict[str, torch.Tensor], alphas: dict[str, float]
                                 ) -> tuple[dict[str, torch.Tensor], dict[str, float]]:
    """A DiT LoRA on diffusers' modules (`<path>.lora_A/B.weight`, alpha per path) on the original modules, at the
    same strength. Where q, k and v's scales (alpha / rank) differ they are folded into the up and alpha = rank."""
    out, out_alphas, groups = {}, {}, {}
    for key in sd:
        if not key.endswith(".lora_A.weight"):
            continue
        path = key[: -len(".lora_A.weight")]
        m = _SPLIT.match(path)
        if m:
            groups.setdefault(f"{m['head']}qkv", {})["qkv".index(m["part"])] = path
            continue
        name = re.sub(r"(layers\.\d+\.attention\.)to_out\.0$", r"\1o", path)
        out[f"{name}.lora_A.weight"] = sd[f"{path}.lora_A.weight"]
        out[f"{name}.lora_B.weight"] = sd[f"{path}.lora_B.weight"]
        out_alphas[name] = alphas[path]
    for fused, parts in groups.items():
        ref = sd[f"{next(iter(parts.values()))}.lora_B.weight"]
        width = ref.shape[0]
        ranks = {i: sd[f"{p}.lora_A.weight"].shape[0] for i, p in parts.items()}
        scales = {i: alphas[p] / ranks[i] for i, p in parts.items()}
        same = len(set(scales.values())) == 1
        total = sum(ranks.values())
        up = torch.zeros(3 * width, total, dtype=ref.dtype)
        downs, col = [], 0
        for i in sorted(parts):
            b = sd[f"{parts[i]}.lora_B.weight"]
            up[i * width:(i + 1) * width, col:col + ranks[i]] = b if same else b * scales[i]
            downs.append(sd[f"{parts[i]}.lora_A.weight"])
            col += ranks[i]
        out[f"{fused}.lora_A.weight"] = torch.cat(downs, dim=0)
        out[f"{fused}.lora_B.weight"] = up
        out_alphas[fused] = next(iter(scales.values())) * total if same else float(total)
    return out, out_alphas


def convert_original_named_lora(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """A LoRA file in the original names (any prefix: `diffusion_model.`, the reference's bare names with
    `.default`, ...) -> the same file in diffusers' module names; None for a file with no original-only name."""
    if not any(_FUSED_KEY.match(k) or _OUT_KEY.match(k) for k in state):
        return None
    out = {}
    for key, value in state.items():
        m = _FUSED_KEY.match(key)
        if m:
            rest = m["rest"]
            if rest.startswith(("lora_B", "lora_up")):
                for part, chunk in zip(_PARTS, value.chunk(3, dim=0)):
                    out[f"{m['head']}{part}.{rest}"] = chunk.contiguous()
            else:
                for part in _PARTS:
                    out[f"{m['head']}{part}.{rest}"] = value.clone()
            continue
        m = _OUT_KEY.match(key)
        out[f"{m['head']}to_out.0.{m['rest']}" if m else key] = value
    return out


_BLOCKS = re.compile(r"^layers\.\d+\.")


def ideogram4_lora_export_notes(layout: str, paths: list[str]) -> list[str]:
    """What a reader skips or refuses of a DiT LoRA on the diffusers modules `paths` written in `layout`."""
    outside = sorted(p for p in paths if not _BLOCKS.match(p))
    if layout == "comfyui" and outside:
        return [f"Ideogram-4 LoRA on modules outside the blocks ({', '.join(outside)}; the reference's "
                f"'adaln_modulation' includes the final layer's) in the original names: diffusers' "
                f"Ideogram4LoraLoaderMixin refuses the file (its converter reads the blocks only); the reference's "
                f"loader and ComfyUI read it. The diffusers layout (the default) is the file diffusers reads"]
    if layout == "diffusers":
        return ["Ideogram-4 LoRA in diffusers' layout (the default): diffusers reads it; the reference's loader and "
                "ComfyUI, whose DiTs have a fused attention.qkv, load nothing of it: --lora_format comfyui writes the "
                "file they read"]
    return []


__all__ = ["convert_original_named_lora", "ideogram4_lora_export_notes", "original_lora_from_diffusers"]
