"""A tiny workspace where every Qwen-Image-family script of the reference runs with only its script path
changed: `./models/<hub id>/` for every repository the scripts name (hub ids resolve there without a
download) and `./data/diffsynth_example_dataset/qwen_image/<name>/` in each data set's format."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from PIL import Image, ImageDraw

from ..common import populate_offline_hub
from difftune.families.qwen_image.components import LORA_TARGET_MODULES
from .tiny import (TinyQwenImageSpec, write_control_dataset, write_layered_dataset, write_tiny_blockwise_controlnet,
                   write_tiny_dit_lora, write_tiny_qwen_image, write_tiny_qwen_image_layered)

DATA = Path("data") / "diffsynth_example_dataset" / "qwen_image"
COLORS = [(220, 40, 40), (40, 60, 220), (40, 180, 70), (230, 220, 50)]


def _picture(path: Path, i: int, size=(32, 32), mode="RGB") -> str:
    img = Image.new(mode, size, COLORS[(i + 1) % 4] + ((255,) if mode == "RGBA" else ()))
    w, h = size
    ImageDraw.Draw(img).ellipse((w // 4, h // 4, 3 * w // 4, 3 * h // 4), fill=COLORS[i % 4])
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return path.name


def _csv(folder: Path, rows: list[dict]) -> None:
    cols = list(rows[0])
    lines = [",".join(cols)] + [",".join(f'"{r[c]}"' if isinstance(r[c], str) else str(r[c]) for c in cols)
                                for r in rows]
    (folder / "metadata.csv").write_text("\n".join(lines) + "\n")


def _json(folder: Path, rows: list[dict]) -> None:
    (folder / "metadata.json").write_text(json.dumps(rows, indent=1))


def text_to_image(folder: Path, n: int = 2) -> None:
    _csv(folder, [{"image": _picture(folder / f"image_{i}.png", i), "prompt": f"a circle number {i}"}
                  for i in range(n)])


def distill(folder: Path) -> None:
    _csv(folder, [{"image": _picture(folder / "image_0.png", 0), "prompt": "a circle", "seed": 0,
                   "rand_device": "cpu", "num_inference_steps": 2, "cfg_scale": 4}])


def edit(folder: Path) -> None:
    _csv(folder, [{"image": _picture(folder / f"image_{i}.png", i), "prompt": "make it blue",
                   "edit_image": _picture(folder / f"edit_{i}.png", i + 1)} for i in range(2)])


def multi_edit(folder: Path) -> None:
    """Edit-Plus rows: `edit_image` lists two pictures of different sizes."""
    rows = [{"image": _picture(folder / f"image_{i}.png", i), "prompt": "put the two together",
             "edit_image": [_picture(folder / f"edit_{i}_a.png", i + 1),
                            _picture(folder / f"edit_{i}_b.png", i + 2, size=(48, 32))]} for i in range(2)]
    _json(folder, rows)


def _control(kind: str):
    return lambda folder: write_control_dataset(folder, kind)


def layered(layer_num: int):
    """Qwen-Image-Layered rows (metadata.json): `image` a list of RGBA layers, `layer_input_image`, `layer_num`."""
    return lambda folder: write_layered_dataset(folder, n=2, size=(32, 32), layer_num=layer_num)


def layered_with_context(folder: Path) -> None:
    """Qwen-Image-Layered-Control-V2: one layer per row, plus a `context_image` (the brush mask)."""
    meta = write_layered_dataset(folder, n=2, size=(32, 32), layer_num=0)
    rows = json.loads(meta.read_text())
    for i, row in enumerate(rows):
        row["context_image"] = _picture(folder / f"mask_{i}.png", i)
    _json(folder, rows)


# data set folder -> writer; a feature adds its own
DATASETS = {
    "Qwen-Image-EliGen": _control("eligen"), "Qwen-Image-EliGen-Poster": _control("eligen"),
    "Qwen-Image-In-Context-Control-Union": _control("context"),
    "Qwen-Image-Blockwise-ControlNet-Canny": _control("controlnet"),
    "Qwen-Image-Blockwise-ControlNet-Depth": _control("controlnet"),
    "Qwen-Image-Blockwise-ControlNet-Inpaint": _control("inpaint"),
    "Qwen-Image": text_to_image, "Qwen-Image-2512": text_to_image, "Qwen-Image-Distill-Full": text_to_image,
    "Qwen-Image-Distill-LoRA": distill, "Qwen-Image-Edit": edit, "Qwen-Image-Edit-2509": multi_edit,
    "Qwen-Image-Edit-2511": multi_edit, "FireRed-Image-Edit-1.0": multi_edit, "FireRed-Image-Edit-1.1": multi_edit,
    "Qwen-Image-Layered": layered(2), "Qwen-Image-Layered-Control": layered(0),
    "Qwen-Image-Layered-Control-V2": layered_with_context,
}


def write_qwen_image_script_workspace(root: str | os.PathLike) -> Path:
    root = Path(root)
    src = root / ".tiny"
    # The narrowest VAE (first width 2): the Edit scripts' pictures are a megapixel, and a width-8 tiny VAE
    # takes ~16 s per encode of one on a CPU.
    spec = TinyQwenImageSpec(vae_base_dim=2)
    base = write_tiny_qwen_image(src / "qwen_image", spec)
    edit_repo = write_tiny_qwen_image(src / "qwen_image_edit", spec, edit=True)
    models = root / "models"
    for repo_id in ("Qwen/Qwen-Image", "Qwen/Qwen-Image-2512"):
        populate_offline_hub(models, repo_id, base)
    for repo_id in ("Qwen/Qwen-Image-Edit", "Qwen/Qwen-Image-Edit-2509", "Qwen/Qwen-Image-Edit-2511",
                    "FireRedTeam/FireRed-Image-Edit-1.0", "FireRedTeam/FireRed-Image-Edit-1.1"):
        populate_offline_hub(models, repo_id, edit_repo)
    layered_repo = write_tiny_qwen_image_layered(src / "qwen_image_layered", spec)
    for repo_id in ("Qwen/Qwen-Image-Layered", "DiffSynth-Studio/Qwen-Image-Layered-Control"):
        populate_offline_hub(models, repo_id, layered_repo)
    # DiffSynth-Studio/Qwen-Image-Distill-Full keeps the transformer's files at the top of the repository.
    shutil.copytree(base / "transformer", models / "DiffSynth-Studio" / "Qwen-Image-Distill-Full", dirs_exist_ok=True)
    for variant in ("Canny", "Depth", "Inpaint"):
        write_tiny_blockwise_controlnet(models / "DiffSynth-Studio" / f"Qwen-Image-Blockwise-ControlNet-{variant}",
                                        inpaint=variant == "Inpaint")
    # the released LoRAs that lora/Qwen-Image-EliGen-Poster.sh and -In-Context-Control-Union.sh continue from
    for repo_id, rank in (("DiffSynth-Studio/Qwen-Image-EliGen-V2", 32),
                          ("DiffSynth-Studio/Qwen-Image-In-Context-Control-Union", 64)):
        write_tiny_dit_lora(models / repo_id / "model.safetensors", rank, LORA_TARGET_MODULES)
    for name, write in DATASETS.items():
        folder = root / DATA / name
        folder.mkdir(parents=True, exist_ok=True)
        write(folder)
    return root
