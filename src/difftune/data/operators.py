"""Data operators: small steps that turn a metadata value into what a pipeline takes.

An operator is called as `op(value, context)`; `context` (optional) says where the value came from
(`where`: "metadata.csv row 3", `key`: the column, `file`: the resolved path) so every error names the
row and the file. Operators compose with `>>` or as a list.

Images are PIL images and a video is a list of PIL frames: `ImageCropAndResize` takes either, and the
video loader (`data/video.py`) is one more entry in `RouteByExtension`.

`check(value, context)` is the cheap half of loading (exists, not empty, header readable, not cut short);
the dataset uses it to pre-check every row before training. It returns the value for the next operator,
or `CHECKED` once nothing more can be checked without decoding.
"""

from __future__ import annotations

import functools
import math
import os
import re
from collections.abc import Callable, Iterable
from typing import NamedTuple

from PIL import Image

from ..errors import DataError, UserError, one_line  # noqa: F401  (DataError: re-exported, data's error)
from ..media.image import check_image, image_size, load_image, to_rgb  # noqa: F401  (to_rgb: re-exported)

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".gif")
CHECKED = object()  # returned by `check` when the rest can only be checked by loading
UNKNOWN = object()  # returned by `shape` when the size can only be known by loading

class Frames(NamedTuple):
    """How long a clip file is, for the row check (`DataOperator.extent`): the frames the file holds, counted no
    further than the operator reads (`available`), and the frames it loads (`kept`: cut to the time division)."""

    available: int
    kept: int


class Seconds(NamedTuple):
    """How long an audio file is, for the row check (`DataOperator.extent`)."""

    seconds: float


URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.IGNORECASE)  # http(s)://, s3://, gs://, ...


def _where(context: dict | None) -> str:
    context = context or {}
    where = context.get("where") or "data"
    return f"{where} '{context['key']}'" if context.get("key") else where


class DataOperator:
    """Base class: `__call__(value, context=None)` transforms; `check` validates cheaply."""

    def __call__(self, value, context: dict | None = None):  # pragma: no cover - abstract
        raise NotImplementedError

    def check(self, value, context: dict | None = None):
        return CHECKED

    def shape(self, value, context: dict | None = None):
        """What `__call__` would give, as a size, without decoding: (width, height) for a picture; UNKNOWN
        where it cannot tell (the data set then loads the sample to see)."""
        return UNKNOWN

    def extent(self, value, context: dict | None = None):
        """How long what `__call__` gives is in time (`Frames` of a clip, `Seconds` of audio), from the header or
        by counting, without loading it; UNKNOWN where the operator does not say. A step that turns the value
        into another (a path) returns that value for the next step."""
        return UNKNOWN

    def __rshift__(self, other) -> Sequence:
        return Sequence([self, compose(other)])


class Sequence(DataOperator):
    """Operators applied in order."""

    def __init__(self, operators: Iterable):
        self.operators: list[DataOperator] = []
        for op in operators:
            op = compose(op)
            self.operators.extend(op.operators if isinstance(op, Sequence) else [op])

    def __call__(self, value, context=None):
        for op in self.operators:
            value = op(value, context)
        return value

    def check(self, value, context=None):
        for op in self.operators:
            value = op.check(value, context)
            if value is CHECKED:
                break
        return CHECKED

    def shape(self, value, context=None):
        for op in self.operators:
            value = op.shape(value, context)
            if value is UNKNOWN:
                break
        return value

    def extent(self, value, context=None):
        for op in self.operators:
            value = op.extent(value, context)
            if value is UNKNOWN or isinstance(value, (Frames, Seconds)):
                break
        return value


class Lambda(DataOperator):
    """Wrap a one-argument function (DiffSynth-Studio's operators take only the value)."""

    def __init__(self, fn: Callable):
        self.fn = fn

    def __call__(self, value, context=None):
        return self.fn(value)


def compose(ops) -> DataOperator:
    """An operator from an operator, a list of operators, or a one-argument callable."""
    if isinstance(ops, DataOperator):
        return ops
    if isinstance(ops, (list, tuple)):
        return Sequence(ops)
    if callable(ops):
        return Lambda(ops)
    raise TypeError(f"not a data operator: {ops!r}")


class ToAbsolutePath(DataOperator):
    """A metadata file name, relative to `base_path` unless already absolute."""

    def __init__(self, base_path: str | os.PathLike = ""):
        self.base_path = os.fspath(base_path or "")

    def __call__(self, value, context=None):
        if not isinstance(value, str) or not value.strip():
            raise DataError(f"{_where(context)}: not a file name: {value!r}")
        path = value.strip()
        if URL.match(path):  # else reported as a missing file under the base path, which misleads
            raise DataError(f"{_where(context)}: {path} is a URL; URLs are not downloaded: download the files and "
                            "list local paths")
        path = path if os.path.isabs(path) else os.path.join(self.base_path, path)
        if context is not None:
            context["file"] = path
        return path

    check = shape = extent = __call__


class LoadImage(DataOperator):
    """Open an image file as the picture a viewer shows (media.image.load_image: EXIF orientation applied, every PIL
    mode decoded to 8-bit `mode`, RGB by default); every failure names the row and the file."""

    def __init__(self, mode: str = "RGB"):
        self.mode = mode

    def __call__(self, path, context=None):
        return load_image(os.fspath(path), self.mode, where=_where(context))

    def shape(self, path, context=None):
        """(width, height) as loaded, from the header: EXIF orientations 5-8 stand the picture on its side."""
        size = image_size(os.fspath(path))
        return UNKNOWN if size is None else size

    def check(self, path, context=None):
        """Header, mode and the format's end marker: a few hundred bytes per file (media.image.check_image)."""
        check_image(os.fspath(path), self.mode, where=_where(context))
        return CHECKED

    def extent(self, path, context=None):
        return Frames(1, 1)  # a still: a one-frame clip


class RouteByExtension(DataOperator):
    """Send a path to the operator registered for its extension, e.g. {IMAGE_EXTENSIONS: LoadImage()};
    a video loader is one more entry. The key None is the fallback."""

    def __init__(self, routes: dict):
        self.routes: list[tuple[tuple[str, ...] | None, DataOperator]] = []
        for exts, op in routes.items():
            if exts is not None:
                exts = (exts,) if isinstance(exts, str) else tuple(exts)
                exts = tuple(e.lower() if e.startswith(".") else f".{e.lower()}" for e in exts)
            self.routes.append((exts, compose(op)))

    @property
    def extensions(self) -> tuple[str, ...]:
        return tuple(e for exts, _ in self.routes if exts for e in exts)

    def route(self, path, context=None) -> DataOperator:
        ext = os.path.splitext(os.fspath(path))[1].lower()
        for exts, op in self.routes:
            if exts is None or ext in exts:
                return op
        from ..media.audio import AUDIO_EXTENSIONS

        if ext in AUDIO_EXTENSIONS:  # an audio column is read by the operator its family declares for it
            raise DataError(f"{_where(context)}: an audio file ('{ext}') where this run reads "
                            f"{', '.join(self.extensions)} files (no part of it reads this column as audio): {path}")
        raise DataError(f"{_where(context)}: unsupported file type '{ext or '(no extension)'}' "
                        f"(expected {', '.join(self.extensions)}): {path}")

    def __call__(self, path, context=None):
        return self.route(path, context)(path, context)

    def check(self, path, context=None):
        return self.route(path, context).check(path, context)

    def shape(self, path, context=None):
        return self.route(path, context).shape(path, context)

    def extent(self, path, context=None):
        return self.route(path, context).extent(path, context)


class RouteByListing(DataOperator):
    """One operator for a column's single values, another for the items of its list values (the dataset's
    context says which: `many`). The reference loads a list-valued `image` (Qwen-Image-Layered's layers) as
    RGBA and a single one as RGB."""

    def __init__(self, single, items):
        self.single, self.items = compose(single), compose(items)

    def route(self, context) -> DataOperator:
        return self.items if (context or {}).get("many") else self.single

    def __call__(self, value, context=None):
        return self.route(context)(value, context)

    def check(self, value, context=None):
        return self.route(context).check(value, context)

    def shape(self, value, context=None):
        return self.route(context).shape(value, context)

    def extent(self, value, context=None):
        return self.route(context).extent(value, context)


def target_size(width: int, height: int, fixed_height: int | None, fixed_width: int | None, max_pixels: int,
                height_factor: int = 16, width_factor: int = 16) -> tuple[int, int]:
    """(width, height) an image of this size is cropped to. Fixed sizes win; otherwise an image over
    `max_pixels` is scaled down by sqrt(area / max_pixels) (never up), then each side is rounded down to
    its division factor (DiffSynth-Studio's rule)."""
    if fixed_height is not None and fixed_width is not None:
        return int(fixed_width), int(fixed_height)
    if max_pixels is not None and width * height > max_pixels:
        scale = math.sqrt(width * height / max_pixels)
        width, height = int(width / scale), int(height / scale)
    return width // width_factor * width_factor, height // height_factor * height_factor


ORIGINAL_SIZE, CROP_TOP_LEFT = "difftune_original_size", "difftune_crop_top_left"  # keys of a cropped image's info


def cover_crop(img: Image.Image, width: int, height: int) -> Image.Image:
    """Scale (bilinear) so the image covers (width, height), then centre-crop, as torchvision's
    resize + center_crop do in the reference."""
    h0, w0 = img.height, img.width
    scale = max(width / img.width, height / img.height)
    w, h = round(img.width * scale), round(img.height * scale)
    if (w, h) != img.size:
        img = img.resize((w, h), Image.BILINEAR)
    left, top = int(round((w - width) / 2.0)), int(round((h - height) / 2.0))
    out = img.crop((left, top, left + width, top + height))
    # what a size-conditioned model is told (SDXL's micro-conditioning): the picture's size before the resize and
    # where the crop starts in the resized picture, (height, width) and (top, left)
    out.info[ORIGINAL_SIZE] = img.info.get(ORIGINAL_SIZE, (h0, w0))
    out.info[CROP_TOP_LEFT] = (top, left)
    return out


class ImageCropAndResize(DataOperator):
    """Fixed `height`/`width`: scale to cover and centre-crop. Both None (dynamic resolution): keep the
    image's size, scaled down to `max_pixels` and rounded down to the division factors. Works on one
    PIL image or a list of frames."""

    def __init__(self, height: int | None = None, width: int | None = None, max_pixels: int | None = 1024 * 1024,
                 height_division_factor: int = 16, width_division_factor: int = 16, keep_small: bool = False):
        """`keep_small`: an image too small for the division factors is passed on as it is (a mask the model
        resizes itself) instead of refused."""
        if (height is None) != (width is None):
            raise UserError("--height and --width must be given together (or neither, for dynamic resolution)")
        self.height, self.width, self.max_pixels = height, width, max_pixels
        self.height_division_factor, self.width_division_factor = height_division_factor, width_division_factor
        self.keep_small = keep_small

    def size_for(self, img: Image.Image, context=None) -> tuple[int, int] | None:
        fh, fw = self.height_division_factor, self.width_division_factor
        w, h = target_size(img.width, img.height, self.height, self.width, self.max_pixels, fh, fw)
        if w < 1 or h < 1:
            if self.keep_small:
                return None
            file = (context or {}).get("file", "")
            if img.width >= fw and img.height >= fh and self.height is None:  # the flag shrank it
                least = max(fw * fh, math.ceil(max(fw / img.width, fh / img.height) ** 2 * img.width * img.height))
                raise DataError(f"{_where(context)}: --max_pixels {self.max_pixels} scales this {img.width}x"
                                f"{img.height} image below the model's {fw}x{fh} size factor; raise --max_pixels to "
                                f"at least {least}: {file}")
            raise DataError(f"{_where(context)}: image is {img.width}x{img.height}, smaller than the division "
                            f"factor ({fw}x{fh}): {file}")
        return w, h

    def shape(self, value, context=None):
        """(width, height) -> the cropped size; (width, height, frames) of a clip keeps its frame count."""
        if isinstance(value, tuple) and len(value) in (2, 3):
            size = target_size(value[0], value[1], self.height, self.width, self.max_pixels,
                               self.height_division_factor, self.width_division_factor)
            return (value[:2] if self.keep_small and min(size) < 1 else size) + value[2:]
        return UNKNOWN

    def __call__(self, value, context=None):
        if isinstance(value, list):  # video frames
            return [self._one(f, context) for f in value]
        return self._one(value, context)

    def _one(self, img, context):
        size = self.size_for(img, context)
        return img if size is None else cover_crop(img, *size)
