"""Helpers shared by the tiny variant writers."""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch


def randomise(model: torch.nn.Module, seed: int, scale: float = 0.2) -> torch.nn.Module:
    """Every parameter drawn from a seeded generator (zero-initialised ones too, so each one matters in a
    test): norms' weights near 1, the rest N(0, scale^2)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            noise = torch.randn(p.shape, generator=generator, dtype=torch.float32) * scale
            is_norm = name.rsplit(".", 1)[-1] == "weight" and p.dim() == 1 and "norm" in name
            p.copy_((1 + noise * 0.5) if is_norm else noise)
    return model.eval()


def wan_common_files(root: Path, clip: bool = False) -> None:
    """Wan-AI's UMT5 (.pth), Wan2.1 VAE (.pth), with `clip` the CLIP .pth, and the UMT5 tokenizer
    (google/umt5-xxl/) of a tiny Wan2.1 repository, copied into `root` (its DiT is not)."""
    from .tiny import CLIP_PTH, write_tiny_wan_original

    root.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as work:
        original, _ = write_tiny_wan_original(Path(work), "i2v" if clip else "t2v")
        names = ["models_t5_umt5-xxl-enc-bf16.pth", "Wan2.1_VAE.pth"] + ([CLIP_PTH] if clip else [])
        for name in names:
            shutil.copy(original / name, root / name)
        shutil.copytree(original / "google", root / "google", dirs_exist_ok=True)


TEXT_DIM = 32  # the tiny UMT5's width (testing.wan.TinyWanSpec.text_dim)
