"""Saving what was trained: LoRA files that diffusers and ComfyUI load, full models with official keys.

A LoRA is saved in diffusers' layout (`transformer.<module>.lora_A.weight` + alpha/rank metadata), which
diffusers' `load_lora_weights` and ComfyUI load unchanged. A fully trained model is saved with the
reference's naming (`pipe.<model>.<key>`) minus `--remove_prefix_in_ckpt`; with the default
`pipe.dit.` that leaves the official diffusers key names, so the file loads into
`QwenImageTransformer2DModel`. Every file is written to a temporary name and renamed.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from .. import __version__
from ..io import atomic_save_safetensors

def _split_by_model(state: dict[str, torch.Tensor], names: list[str]) -> dict[str, dict[str, torch.Tensor]]:
    """Trainable entries of the module's state dict, grouped by pipeline model, keyed inside the model."""
    per_model: dict[str, dict[str, torch.Tensor]] = {}
    for name in names:
        if not name.startswith("pipe_models."):
            continue
        model, _, key = name[len("pipe_models."):].partition(".")
        per_model.setdefault(model, {})[key] = state[name]
    return per_model


class CheckpointSaver:
    """Writes `<output_path>/<name>.safetensors` (and `<name>-<model>.safetensors` for extra full models)."""

    def __init__(self, output_path: str, remove_prefix: str | None = "pipe.dit.", base_info: dict | None = None):
        self.output_path = Path(output_path)
        self.remove_prefix = remove_prefix or ""
        self.base_info = base_info or {}
        self.saved: list[Path] = []

    def save(self, accelerator, module, name: str) -> list[Path]:
        accelerator.wait_for_everyone()
        state = accelerator.get_state_dict(module)  # gathers sharded weights (ZeRO-3 / FSDP)
        inner = accelerator.unwrap_model(module)
        written: list[Path] = []
        if accelerator.is_main_process:
            written = self.write(inner, state, name)
        accelerator.wait_for_everyone()
        return written

    def write(self, inner, state: dict[str, torch.Tensor], name: str) -> list[Path]:
        from .lora import canonical_lora_keys, save_lora

        per_model = _split_by_model(state, inner.trainable_param_names())
        lora = {m: sd for m, sd in per_model.items() if m in inner.lora_configs}
        full = {m: sd for m, sd in per_model.items() if m not in inner.lora_configs}
        written = []
        if lora:
            path = self.output_path / f"{name}.safetensors"
            save_lora(path, {m: canonical_lora_keys(sd) for m, sd in lora.items()},
                      {m: inner.lora_configs[m] for m in lora}, base_info=self.base_info)
            written.append(path)
        for model, sd in full.items():
            prefixed = {f"pipe.{model}.{k}": v for k, v in sd.items()}
            out = {(k[len(self.remove_prefix):] if self.remove_prefix and k.startswith(self.remove_prefix) else k): v
                   for k, v in prefixed.items()}
            single = not lora and len(full) == 1
            path = self.output_path / (f"{name}.safetensors" if single else f"{name}-{model}.safetensors")
            meta = {"format": "pt", "difftune_version": __version__, "difftune_model": model,
                    "difftune_base": json.dumps(self.base_info)}
            atomic_save_safetensors(out, path, metadata=meta)
            written.append(path)
        self.saved.extend(written)
        return written
