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

from PIL import Image, ImageOps, UnidentifiedImageError

from ..errors import UserError
from ..util import file_problem

IMAGE_EXTENSIONS = (".png", ".jpg", ".jpeg", ".webp", ".bmp", ".tif", ".tiff", ".gif")
CHECKED = object()  # returned by `check` when the rest can only be checked by loading
UNKNOWN = object()  # returned by `shape` when the size can only be known by loading
URL = re.compile(r"^[a-z][a-z0-9+.-]*://", re.IGNORECASE)  # http(s)://, s3://, gs://, ...


def one_line(text) -> str:
    return " ".join(str(text).split("\n")).replace("\r", " ").strip()


class DataError(UserError):
    """A bad metadata file or sample: one line naming the file (and the row).

    A DataLoader worker's exception reaches the main process as `DataError(<worker traceback>)` (torch
    rebuilds it from the formatted traceback), so the constructor recovers the original one-line message
    from the traceback's last line. Pickling keeps the message (it is the only argument)."""

    def __init__(self, message: str = ""):
        text = str(message)
        if text.startswith("Caught ") and "Traceback" in text:
            last = text.rstrip().splitlines()[-1]
            marker = f"{type(self).__name__}: "
            at = last.find(marker)
            if at >= 0:
                text = last[at + len(marker):]
        super().__init__(one_line(text))


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

    check = shape = __call__


ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")
INT16_MODES = ("I;16", "I;16L", "I;16B", "I;16N")
EXIF_IN_HEADER = ("JPEG", "MPO", "TIFF", "WEBP")
BACKGROUND = (255, 255, 255)  # transparent pixels become white, as an image viewer on a white page shows them


def _as_uint8(values, path: str, context) -> Image.Image:
    """An 8-bit grey image from the pixel values of a 16-bit, 32-bit integer or float image.

    - 16-bit integer (I;16*): 0..65535 -> 0..255 (x / 257).
    - 32-bit integer (I): 0..65535 is taken as 16-bit (PIL opens 16-bit PNG/TIFF/PGM files as I in some
      versions); any other range (negative values, or above 65535) is stretched from its min..max.
    - float (F): 0..1 -> x 255; else 0..255 as is; else stretched from its min..max. NaN/Inf is refused.
    """
    import numpy as np

    arr = np.asarray(values, dtype=np.float64)
    if arr.size and not np.isfinite(arr).all():
        raise DataError(f"{_where(context)}: image has NaN or infinite pixel values (mode {values.mode}): {path}")
    lo, hi = (float(arr.min()), float(arr.max())) if arr.size else (0.0, 0.0)
    if values.mode in INT16_MODES or (values.mode == "I" and lo >= 0 and hi <= 65535):
        arr = arr / 257.0
    elif values.mode == "F" and lo >= 0 and hi <= 1:
        arr = arr * 255.0
    elif not (values.mode == "F" and lo >= 0 and hi <= 255):
        arr = (arr - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(arr)
    return Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8), mode="L")


def _convert(img: Image.Image, path: str, context, mode: str) -> Image.Image:
    if img.mode in INT16_MODES or img.mode in ("I", "F"):
        img = _as_uint8(img, path, context)
    if img.mode == "La":  # premultiplied: PIL converts it to RGBA only through LA
        img = img.convert("LA")
    if mode in ("RGB", "L") and (img.mode in ALPHA_MODES or "transparency" in img.info):
        rgba = img.convert("RGBA")
        img = Image.alpha_composite(Image.new("RGBA", rgba.size, BACKGROUND + (255,)), rgba)
    return img if img.mode == mode else img.convert(mode)


def to_rgb(img: Image.Image, path: str = "", context: dict | None = None, mode: str = "RGB") -> Image.Image:
    """The picture an image viewer shows, as 8-bit `mode` (RGB by default): 16/32-bit and float pixels
    scaled to 0..255 (see `_as_uint8`), transparency (alpha, or a palette/colour key) composited on white
    unless `mode` keeps alpha, CMYK/YCbCr/LAB/HSV/1-bit/palette converted. A mode PIL cannot convert is
    refused in one line naming the file and the mode. EXIF orientation is applied by the caller."""
    try:
        return _convert(img, path, context, mode)
    except ValueError as err:
        raise DataError(f"{_where(context)}: cannot convert image mode {img.mode!r} to {mode} "
                        f"({one_line(err)}): {path}") from None


@functools.lru_cache(maxsize=None)
def _unconvertible(mode: str, target: str) -> str | None:
    """None if images of `mode` convert to `target`, else PIL's reason (tried on a 1x1 image)."""
    try:
        _convert(Image.new(mode, (1, 1)), "", None, target)
    except ValueError as err:
        return one_line(err)
    return None


def _orient(img: Image.Image, path: str, context, apply: bool = True) -> Image.Image:
    """The image turned as its EXIF orientation says (a camera's portrait photo stands up). EXIF that PIL
    cannot parse is refused: the picture might be sideways."""
    try:
        if not apply:
            img.getexif()
            return img
        return ImageOps.exif_transpose(img)
    except Exception as err:  # PIL's EXIF parser raises struct, key, value and type errors alike
        raise DataError(f"{_where(context)}: unreadable EXIF data ({type(err).__name__}: {one_line(err)}), so its "
                        f"orientation is unknown; remove the EXIF data (e.g. re-save the image): {path}") from None


class LoadImage(DataOperator):
    """Open an image file as the picture a viewer shows (EXIF orientation applied, every PIL mode decoded
    to 8-bit `mode`, RGB by default: see `to_rgb`); every failure names the row and the file."""

    def __init__(self, mode: str = "RGB"):
        self.mode = mode

    def _open(self, path, context, decode: bool):
        """decode=False: the header only (format, size, mode), returns the format; else the picture."""
        problem = file_problem(path)
        if problem:
            raise DataError(f"{_where(context)}: {problem}: {path}")
        try:
            with Image.open(path) as img:
                if not decode:
                    why = _unconvertible(img.mode, self.mode)  # the mode is in the header: refuse it here already
                    if why:
                        raise DataError(f"{_where(context)}: cannot convert image mode {img.mode!r} to "
                                        f"{self.mode} ({why}): {path}")
                    if img.format in EXIF_IN_HEADER:  # (a PNG's may follow its pixels: found when loaded)
                        _orient(img, path, context, apply=False)
                    return img.format
                img.load()  # decode now, so a truncated file fails here with its row and file named
                return to_rgb(_orient(img, path, context), path, context, self.mode)
        except UnidentifiedImageError:
            raise DataError(f"{_where(context)}: not an image (PIL cannot read its format): {path}") from None
        except Image.DecompressionBombError:
            raise DataError(f"{_where(context)}: image too large (over PIL's pixel limit): {path}") from None
        except (OSError, SyntaxError, ValueError, EOFError) as err:
            raise DataError(f"{_where(context)}: unreadable or corrupt image ({one_line(err)}): {path}") from None

    def __call__(self, path, context=None):
        return self._open(os.fspath(path), context, decode=True)

    def shape(self, path, context=None):
        """(width, height) as loaded, from the header: EXIF orientations 5-8 stand the picture on its side."""
        path = os.fspath(path)
        try:
            with Image.open(path) as img:
                size = img.size
                orientation = img.getexif().get(0x0112)  # (a PNG's EXIF after its pixels is not seen here)
        except Exception:  # the pre-check and the load report what is wrong with the file
            return UNKNOWN
        return (size[1], size[0]) if orientation in (5, 6, 7, 8) else size

    def check(self, path, context=None):
        """Header, mode and the format's end marker: a few hundred bytes per file. A file whose end marker
        is missing (truncated, or trailing bytes after it) is decoded to tell, so the check rejects only
        what loading rejects and skipping never drops a row that error mode would train on."""
        path = os.fspath(path)
        if not _looks_whole(path, self._open(path, context, decode=False)):
            self._open(path, context, decode=True)
        return CHECKED


PNG_END = b"\x00\x00\x00\x00IEND\xaeB`\x82"


def _looks_whole(path: str, fmt: str | None) -> bool:
    """Does the file end where its format says (PNG IEND, JPEG EOI, GIF trailer, RIFF/BMP length)? True
    for formats without a cheap end check (TIFF): their header is all the check reads."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        head = f.read(12)
        f.seek(max(0, size - 12))
        tail = f.read()
    if fmt == "PNG":
        return tail.endswith(PNG_END)
    if fmt in ("JPEG", "MPO"):
        return tail.endswith(b"\xff\xd9")
    if fmt == "GIF":
        return tail.endswith(b";")
    if fmt == "WEBP":
        return int.from_bytes(head[4:8], "little") + 8 == size
    if fmt == "BMP":
        return int.from_bytes(head[2:6], "little") in (0, size)  # some writers leave it 0
    return True


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
        raise DataError(f"{_where(context)}: unsupported file type '{ext or '(no extension)'}' "
                        f"(expected {', '.join(self.extensions)}): {path}")

    def __call__(self, path, context=None):
        return self.route(path, context)(path, context)

    def check(self, path, context=None):
        return self.route(path, context).check(path, context)

    def shape(self, path, context=None):
        return self.route(path, context).shape(path, context)


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


def cover_crop(img: Image.Image, width: int, height: int) -> Image.Image:
    """Scale (bilinear) so the image covers (width, height), then centre-crop, as torchvision's
    resize + center_crop do in the reference."""
    scale = max(width / img.width, height / img.height)
    w, h = round(img.width * scale), round(img.height * scale)
    if (w, h) != img.size:
        img = img.resize((w, h), Image.BILINEAR)
    left, top = int(round((w - width) / 2.0)), int(round((h - height) / 2.0))
    return img.crop((left, top, left + width, top + height))


class ImageCropAndResize(DataOperator):
    """Fixed `height`/`width`: scale to cover and centre-crop. Both None (dynamic resolution): keep the
    image's size, scaled down to `max_pixels` and rounded down to the division factors. Works on one
    PIL image or a list of frames."""

    def __init__(self, height: int | None = None, width: int | None = None, max_pixels: int | None = 1024 * 1024,
                 height_division_factor: int = 16, width_division_factor: int = 16):
        if (height is None) != (width is None):
            raise UserError("--height and --width must be given together (or neither, for dynamic resolution)")
        self.height, self.width, self.max_pixels = height, width, max_pixels
        self.height_division_factor, self.width_division_factor = height_division_factor, width_division_factor

    def size_for(self, img: Image.Image, context=None) -> tuple[int, int]:
        w, h = target_size(img.width, img.height, self.height, self.width, self.max_pixels,
                           self.height_division_factor, self.width_division_factor)
        if w < 1 or h < 1:
            file = (context or {}).get("file", "")
            raise DataError(f"{_where(context)}: image is {img.width}x{img.height}, smaller than the division "
                            f"factor ({self.width_division_factor}x{self.height_division_factor}): {file}")
        return w, h

    def shape(self, value, context=None):
        """(width, height) -> the cropped size; (width, height, frames) of a clip keeps its frame count."""
        if isinstance(value, tuple) and len(value) in (2, 3):
            return target_size(value[0], value[1], self.height, self.width, self.max_pixels,
                               self.height_division_factor, self.width_division_factor) + value[2:]
        return UNKNOWN

    def __call__(self, value, context=None):
        if isinstance(value, list):  # video frames
            return [cover_crop(f, *self.size_for(f, context)) for f in value]
        return cover_crop(value, *self.size_for(value, context))
