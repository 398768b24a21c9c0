"""A tiny workspace where every Z-Image script of the reference runs with only its script path changed:
`./models/<hub id>/` for every repository the scripts name (hub ids resolve there without a download), the LoRAs
two scripts start from, and `./data/diffsynth_example_dataset/z_image/<name>/` in each data set's format."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from ..common import write_example_dataset
from .tiny import TinyZImageSpec, tiny_dit, write_control_dataset, write_edit_dataset, write_tiny_z_image_hub

DATA = Path("data") / "diffsynth_example_dataset" / "z_image"
TARGETS = ("to_q", "to_k", "to_v", "to_out.0", "w1", "w2", "w3")
# data set folder -> writer
DATASETS = {
    "Z-Image-Turbo": lambda folder: write_example_dataset(folder, n=2, size=(32, 32)),
    "Z-Image": lambda folder: write_example_dataset(folder, n=2, size=(32, 32)),
    # the Omni-Base set serves its text-to-image and its image(s)-to-image command
    "Omni": lambda folder: write_edit_dataset(folder, n=2, size=(32, 32), edit_size=(48, 32)),
    "Z-Image-Turbo-Fun-Controlnet-Union-2.1": lambda folder: write_control_dataset(folder, n=2, size=(32, 32)),
    "Z-Image-Turbo-Fun-Controlnet-Union-2.1-8steps": lambda folder: write_control_dataset(folder, n=2, size=(32, 32)),
    "Z-Image-Turbo-Fun-Controlnet-Tile-2.1-8steps": lambda folder: write_control_dataset(folder, n=2, size=(32, 32)),
}


def _dit_lora(path: Path, rank: int, key, seed: int) -> Path:
    """A LoRA on the reference's targets of every block of the tiny DiT, keys named by `key(module, A|B)`."""
    from safetensors.torch import save_file

    dit = tiny_dit(TinyZImageSpec())
    generator = torch.Generator().manual_seed(seed)
    state = {}
    for name, module in dit.named_modules():
        if isinstance(module, torch.nn.Linear) and any(name.endswith("." + t) for t in TARGETS):
            state[key(name, "A")] = torch.randn(rank, module.in_features, generator=generator) / 100
            state[key(name, "B")] = torch.randn(module.out_features, rank, generator=generator) / 100
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))
    return path


def write_z_image_script_workspace(root: str | os.PathLike) -> Path:
    root = Path(root)
    write_tiny_z_image_hub(root / "models")
    # ostris' training adapter the differential script presets (ai-toolkit's layout: diffusion_model.<module>)
    _dit_lora(root / "models" / "ostris" / "zimage_turbo_training_adapter" /
              "zimage_turbo_training_adapter_v1.safetensors", 4,
              lambda name, ab: f"diffusion_model.{name}.lora_{ab}.weight", seed=1)
    # the trajectory-imitation script continues from lora/Z-Image-Turbo.sh's last epoch (the reference's layout)
    _dit_lora(root / "models" / "train" / "Z-Image-Turbo_lora" / "epoch-4.safetensors", 32,
              lambda name, ab: f"{name}.lora_{ab}.default.weight", seed=2)
    for name, write in DATASETS.items():
        folder = root / DATA / ("Z-Image-Omni-Base" if name == "Omni" else name)
        folder.mkdir(parents=True, exist_ok=True)
        write(folder)
    return root
