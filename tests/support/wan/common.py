"""What the tiny variant writers share: the tiny Wan sizes, the base repository in Wan-AI's original layout
(UMT5 / VAE / CLIP .pth, tokenizer) and Wan's own config.json beside a DiT file."""

from __future__ import annotations

import json
import shutil
import tempfile
from pathlib import Path

import torch

from .tiny import TinyWanSpec, write_tiny_wan_original

TINY = TinyWanSpec()
TINY_INNER = TINY.num_attention_heads * TINY.attention_head_dim


def tiny_dit_kwargs(num_layers: int = 2, in_channels: int = 16, out_channels: int = 16, image: bool = False) -> dict:
    """WanTransformer3DModel's arguments at the tiny size (the family's tiny repositories' dims)."""
    return dict(patch_size=(1, 2, 2), num_attention_heads=TINY.num_attention_heads,
                attention_head_dim=TINY.attention_head_dim, in_channels=in_channels, out_channels=out_channels,
                text_dim=TINY.text_dim, freq_dim=16, ffn_dim=TINY.ffn_dim, num_layers=num_layers,
                cross_attn_norm=True, qk_norm="rms_norm_across_heads", eps=1e-6,
                image_dim=TINY.clip_hidden if image else None, added_kv_proj_dim=TINY_INNER if image else None,
                rope_max_seq_len=1024)


def save_tensors(state: dict[str, torch.Tensor], path: Path) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in state.items()}, str(path))
    return path


def write_wan_config(folder: Path, class_name: str, config: dict, **extra) -> None:
    """Wan's own config.json (not in diffusers' terms) beside a DiT file, as the released repositories have."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({
        "_class_name": class_name, "dim": config["num_attention_heads"] * config["attention_head_dim"],
        "ffn_dim": config["ffn_dim"], "num_heads": config["num_attention_heads"],
        "num_layers": config["num_layers"], "in_dim": config["in_channels"], "out_dim": config["out_channels"],
        **extra}))


def write_base_repo(root: Path, variant: str = "t2v") -> tuple[Path, Path]:
    """A tiny Wan-AI repository in the original layout (`write_tiny_wan_original`) whose DiT files the variant
    writers replace; its diffusers twin is moved beside it (`<root>.diffusers`), out of the scripts' globs."""
    root = Path(root)
    folder, twin = write_tiny_wan_original(root, variant)
    moved = root.parent / f"{root.name}.diffusers"
    if moved.exists():
        shutil.rmtree(moved)
    shutil.move(str(twin), str(moved))
    for dit in [root / "diffusion_pytorch_model.safetensors", root / "config.json",
                *root.glob("*_noise_model")]:
        if dit.is_dir():
            shutil.rmtree(dit)
        elif dit.exists():
            dit.unlink()
    return folder, moved


def base_known_configs(twin: Path) -> list[tuple]:
    """(spec, label, config) for the tiny UMT5, VAE and CLIP of a base repository: tests add them to the official
    configs (bare original files are recognised against those)."""
    from difftune.families.wan.components import (IMAGE_ENCODER_ORIGINAL, TEXT_ENCODER_ORIGINAL, VAE22_ORIGINAL,
                                                  VAE_ORIGINAL)

    read = lambda folder: json.loads((twin / folder / "config.json").read_text())  # noqa: E731
    out = [(TEXT_ENCODER_ORIGINAL, "tiny", read("text_encoder"))]
    vae = read("vae")
    out.append((VAE22_ORIGINAL if vae.get("z_dim") == 48 else VAE_ORIGINAL, "tiny", vae))
    if (twin / "image_encoder").is_dir():
        out.append((IMAGE_ENCODER_ORIGINAL, "tiny", read("image_encoder")))
    return out


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


TEXT_DIM = 32  # the tiny UMT5's width (support.wan.TinyWanSpec.text_dim)
