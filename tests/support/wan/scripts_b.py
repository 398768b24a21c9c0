"""The workspace the reference's S2V, Wan-Dancer, LongCat-Video and Video-As-Prompt scripts run in: tiny models
where their --model_id_with_origin_paths look (./models/<repo>/, the released file names and layouts) and tiny
5-frame data sets where their --dataset_base_path points (./data/diffsynth_example_dataset/wanvideo/<name>/)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

DATA = Path("data") / "diffsynth_example_dataset" / "wanvideo"
TOKENIZER = Path("Wan-AI") / "Wan2.1-T2V-1.3B" / "google" / "umt5-xxl"  # the reference's default tokenizer


def write_wan_b_workspace(root: str | os.PathLike) -> tuple[Path, dict[str, dict]]:
    """The workspace, and the configs of its tiny Wan-AI .pth files (slot -> config.json contents: the UMT5, VAE and
    CLIP that stand for the official ones, which recognition matches bare files against)."""
    from ..video import write_example_video_dataset
    from .dancer import write_tiny_dancer
    from .longcat import write_tiny_longcat
    from .scripts import VAE_BASE_DIM
    from .s2v import write_tiny_s2v
    from .tiny import write_tiny_wan_original
    from .variant_data import write_dancer_dataset, write_s2v_dataset, write_vap_dataset
    from .vap import write_tiny_vap

    root = Path(root)
    models = root / "models"
    write_tiny_s2v(models / "Wan-AI" / "Wan2.2-S2V-14B")
    write_tiny_dancer(models)
    write_tiny_longcat(models)
    write_tiny_vap(models)
    shutil.copytree(models / "Wan-AI" / "Wan2.2-S2V-14B" / "google" / "umt5-xxl", models / TOKENIZER)
    # the same tiny UMT5 and CLIP, diffusers layout, and the narrowest VAE, as the main Wan scripts' workspace has:
    # the scripts keep --height 480 --width 832, and a wider tiny VAE takes minutes per clip on a CPU
    build, twin = write_tiny_wan_original(root / "build", "i2v", vae_base_dim=VAE_BASE_DIM)
    for vae in models.rglob("Wan2.1_VAE.pth"):
        shutil.copyfile(build / "Wan2.1_VAE.pth", vae)
    configs = {slot: json.loads((twin / slot / "config.json").read_text())
               for slot in ("text_encoder", "vae", "image_encoder")}
    shutil.rmtree(root / "build")
    data = root / DATA
    write_s2v_dataset(data / "Wan2.2-S2V-14B")
    write_dancer_dataset(data / "Wan-Dancer-14B-global", framewise=True)
    write_dancer_dataset(data / "Wan-Dancer-14B-local")
    write_example_video_dataset(data / "LongCat-Video", n=2, num_frames=5, size=(64, 32))
    write_vap_dataset(data / "Video-As-Prompt-Wan2.1-14B")
    return root, configs


__all__ = ["DATA", "write_wan_b_workspace"]
