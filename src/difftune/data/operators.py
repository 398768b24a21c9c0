"""Data operators: small steps that turn a metadata value into what a pipeline takes.

Operators compose with `>>`. Images are PIL images; a video is a list of PIL frames, so the resize
operator (and anything after it) works on both, and a video loader can be added as one more operator
routed by file extension without changing the rest.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable

from PIL import Image, UnidentifiedImageError

from ..errors import UserError

IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".gif"}


class DataOperator:
    def __call__(self, value, context: dict):  # pragma: no cover - abstract
        raise NotImplementedError

    def __rshift__(self, other: DataOperator) -> DataOperator:
        return Sequence([self, other])


class Sequence(DataOperator):
    def __init__(self, operators):
        self.operators = []
        for op in operators:
            self.operators.extend(op.operators if isinstance(op, Sequence) else [op])

    def __call__(self, value, context):
        for op in self.operators:
            value = op(value, context)
        return value


class ToAbsolutePath(DataOperator):
    def __init__(self, base_path: str):
        self.base_path = base_path

    def __call__(self, value, context):
        if not isinstance(value, str) or not value.strip():
            raise UserError(f"{context['where']}: '{context['key']}' is empty or not a file name ({value!r})")
        return value if os.path.isabs(value) else os.path.join(self.base_path, value)


class LoadImage(DataOperator):
    """Open an image file as RGB; every failure is a one-line error naming the row and the file."""

    def __init__(self, mode: str = "RGB"):
        self.mode = mode

    def __call__(self, path, context):
        where = context["where"]
        if not os.path.exists(path):
            raise UserError(f"{where}: file not found: {path}")
        if os.path.getsize(path) == 0:
            raise UserError(f"{where}: file is empty (0 bytes): {path}")
        try:
            with Image.open(path) as img:
                img.load()
                return img.convert(self.mode)
        except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as err:
            kind = "not an image" if isinstance(err, UnidentifiedImageError) else "unreadable image"
            raise UserError(f"{where}: {kind}: {path} ({type(err).__name__})") from None


class RouteByExtension(DataOperator):
    """Send a path to the operator registered for its extension (images today; video later)."""

    def __init__(self, routes: dict[str, DataOperator]):
        self.routes = routes

    def __call__(self, path, context):
        ext = os.path.splitext(str(path))[1].lower()
        for exts, op in self.routes.items():
            if ext in exts:
                return op(path, context)
        raise UserError(f"{context['where']}: unsupported file type '{ext or '(none)'}': {path}")


def target_size(width: int, height: int, fixed_height: int | None, fixed_width: int | None, max_pixels: int,
                height_factor: int, width_factor: int) -> tuple[int, int]:
    """(width, height) an image of this size becomes: fixed, or scaled down to max_pixels (never up),
    then sides rounded down to the division factors."""
    if fixed_height is not None and fixed_width is not None:
        return fixed_width, fixed_height
    if width * height > max_pixels:
        scale = math.sqrt(max_pixels / (width * height))
        width, height = int(width * scale), int(height * scale)
    return max(width_factor, width // width_factor * width_factor), max(height_factor, height // height_factor * height_factor)


def cover_crop(img: Image.Image, width: int, height: int) -> Image.Image:
    """Scale to cover (width, height), then centre-crop."""
    scale = max(width / img.width, height / img.height)
    w, h = max(width, round(img.width * scale)), max(height, round(img.height * scale))
    if (w, h) != img.size:
        img = img.resize((w, h), Image.BICUBIC)
    left, top = (w - width) // 2, (h - height) // 2
    return img.crop((left, top, left + width, top + height))


class ImageCropAndResize(DataOperator):
    def __init__(self, height: int | None = None, width: int | None = None, max_pixels: int = 1024 * 1024,
                 height_division_factor: int = 16, width_division_factor: int = 16):
        if (height is None) != (width is None):
            raise UserError("--height and --width must be given together (or neither, for dynamic resolution)")
        self.height, self.width, self.max_pixels = height, width, max_pixels
        self.hf, self.wf = height_division_factor, width_division_factor

    def one(self, img: Image.Image) -> Image.Image:
        w, h = target_size(img.width, img.height, self.height, self.width, self.max_pixels, self.hf, self.wf)
        return cover_crop(img, w, h)

    def __call__(self, value, context):
        if isinstance(value, list):  # video frames: one size for all, from the first frame
            return [self.one(f) for f in value]
        return self.one(value)


class Lambda(DataOperator):
    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, value, context):
        return self.fn(value)
