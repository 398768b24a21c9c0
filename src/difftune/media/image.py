"""PIL <-> tensor conversion shared by the image families."""

from __future__ import annotations

import numpy as np
import torch
from PIL import Image


def as_image_list(images) -> list[Image.Image]:
    if isinstance(images, Image.Image):
        return [images]
    return list(images)


def images_to_tensor(images, height: int | None = None, width: int | None = None, mode: str = "RGB") -> torch.Tensor:
    """PIL image(s) -> float tensor (B, C, H, W) in [-1, 1] (C = 3 for RGB, 4 for RGBA), resized to (height, width)
    when given."""
    arrays = []
    for img in as_image_list(images):
        img = img.convert(mode)
        if height is not None and width is not None and img.size != (width, height):
            img = img.resize((width, height), Image.LANCZOS)
        arrays.append(np.asarray(img, dtype=np.float32) / 127.5 - 1.0)
    shapes = {a.shape for a in arrays}
    if len(shapes) > 1:
        raise ValueError(f"images in one batch must have the same size, got {sorted(shapes)}")
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()


def tensor_to_images(x: torch.Tensor) -> list[Image.Image]:
    """Float tensor (B, 3 or 4, H, W) in [-1, 1] -> PIL images (RGB or RGBA)."""
    x = ((x.float().clamp(-1, 1) + 1) * 127.5).round().to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
    return [Image.fromarray(a) for a in x]


# Stage-1 caches hold tensors and JSON only; images that stage 2 needs are stored as uint8 tensors.
IMAGE_MARK = "__difftune_images__"


def images_to_cache(value):
    """PIL image(s) marked as images: one image -> a uint8 tensor (1, H, W, C); a list -> one uint8 tensor
    (H, W, C) per image (the images of one list may differ in size, e.g. Edit-Plus's edit images). C is 4 when an
    image has alpha (Qwen-Image-Layered's RGBA layers keep it), else 3. Anything else unchanged."""
    if isinstance(value, Image.Image):
        mode = "RGBA" if value.mode == "RGBA" else "RGB"
        return {IMAGE_MARK: torch.from_numpy(np.stack([np.asarray(value.convert(mode))])), "single": True}
    if isinstance(value, list) and value and all(isinstance(v, Image.Image) for v in value):
        mode = "RGBA" if any(i.mode == "RGBA" for i in value) else "RGB"
        return {IMAGE_MARK: [torch.from_numpy(np.array(i.convert(mode))) for i in value], "single": False}
    return value


def images_from_cache(value):
    if isinstance(value, dict) and IMAGE_MARK in value:
        images = [Image.fromarray(a.numpy()) for a in value[IMAGE_MARK]]  # a stacked tensor or a list of them
        return images[0] if value.get("single") else images
    return value
