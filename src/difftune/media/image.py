"""Images: the one image decoder (training data, `difftune sample`'s inputs and a video reader's stills all read
files through `load_image`), and PIL <-> tensor conversion shared by the families."""

from __future__ import annotations

import functools
import os
import re

import numpy as np
import torch
from PIL import Image, ImageOps, UnidentifiedImageError

from ..errors import DataError, one_line
from ..util import file_problem

ALPHA_MODES = ("RGBA", "RGBa", "LA", "La", "PA")
INT16_MODES = ("I;16", "I;16L", "I;16B", "I;16N")
EXIF_IN_HEADER = ("JPEG", "MPO", "TIFF", "WEBP")
BACKGROUND = (255, 255, 255)  # transparent pixels become white, as an image viewer on a white page shows them
PNG_END = b"\x00\x00\x00\x00IEND\xaeB`\x82"


def too_large(err: BaseException) -> str:
    """PIL's DecompressionBombError (a header declaring more pixels than PIL decodes, e.g. a GIF's canvas of
    30000 x 30000 in a few bytes) as the words of a one-line refusal."""
    found = re.search(r"\((\d+) pixels\) exceeds limit of (\d+)", str(err))
    if found:
        return (f"image too large: its header declares {int(found[1])} pixels, over the decoder's limit of "
                f"{int(found[2])} (a decompression bomb?)")
    return "image too large: its header declares more pixels than the decoder's limit (a decompression bomb?)"


def _as_uint8(values, path: str, where: str) -> Image.Image:
    """An 8-bit grey image from the pixel values of a 16-bit, 32-bit integer or float image.

    - 16-bit integer (I;16*): 0..65535 -> 0..255 (x / 257).
    - 32-bit integer (I): 0..65535 is taken as 16-bit (PIL opens 16-bit PNG/TIFF/PGM files as I in some
      versions); any other range (negative values, or above 65535) is stretched from its min..max.
    - float (F): 0..1 -> x 255; else 0..255 as is; else stretched from its min..max. NaN/Inf is refused.
    """
    arr = np.asarray(values, dtype=np.float64)
    if arr.size and not np.isfinite(arr).all():
        raise DataError(f"{where}: image has NaN or infinite pixel values (mode {values.mode}): {path}")
    lo, hi = (float(arr.min()), float(arr.max())) if arr.size else (0.0, 0.0)
    if values.mode in INT16_MODES or (values.mode == "I" and lo >= 0 and hi <= 65535):
        arr = arr / 257.0
    elif values.mode == "F" and lo >= 0 and hi <= 1:
        arr = arr * 255.0
    elif not (values.mode == "F" and lo >= 0 and hi <= 255):
        arr = (arr - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(arr)
    return Image.fromarray(np.clip(np.rint(arr), 0, 255).astype(np.uint8), mode="L")


def _convert(img: Image.Image, path: str, where: str, mode: str) -> Image.Image:
    if img.mode in INT16_MODES or img.mode in ("I", "F"):
        img = _as_uint8(img, path, where)
    if img.mode == "La":  # premultiplied: PIL converts it to RGBA only through LA
        img = img.convert("LA")
    if mode in ("RGB", "L") and (img.mode in ALPHA_MODES or "transparency" in img.info):
        rgba = img.convert("RGBA")
        img = Image.alpha_composite(Image.new("RGBA", rgba.size, BACKGROUND + (255,)), rgba)
    return img if img.mode == mode else img.convert(mode)


def to_rgb(img: Image.Image, path: str = "", where: str = "image", mode: str = "RGB") -> Image.Image:
    """The picture an image viewer shows, as 8-bit `mode` (RGB by default): 16/32-bit and float pixels
    scaled to 0..255 (see `_as_uint8`), transparency (alpha, or a palette/colour key) composited on white
    unless `mode` keeps alpha, CMYK/YCbCr/LAB/HSV/1-bit/palette converted. A mode PIL cannot convert is
    refused in one line naming the file and the mode. EXIF orientation is applied by the caller."""
    try:
        return _convert(img, path, where, mode)
    except ValueError as err:
        raise DataError(f"{where}: cannot convert image mode {img.mode!r} to {mode} ({one_line(err)}): {path}") from None


@functools.lru_cache(maxsize=None)
def _unconvertible(mode: str, target: str) -> str | None:
    """None if images of `mode` convert to `target`, else PIL's reason (tried on a 1x1 image)."""
    try:
        _convert(Image.new(mode, (1, 1)), "", "", target)
    except ValueError as err:
        return one_line(err)
    return None


def _orient(img: Image.Image, path: str, where: str, apply: bool = True) -> Image.Image:
    """The image turned as its EXIF orientation says (a camera's portrait photo stands up). EXIF that PIL
    cannot parse is refused: the picture might be sideways."""
    try:
        if not apply:
            img.getexif()
            return img
        return ImageOps.exif_transpose(img)
    except Exception as err:  # PIL's EXIF parser raises struct, key, value and type errors alike
        raise DataError(f"{where}: unreadable EXIF data ({type(err).__name__}: {one_line(err)}), so its "
                        f"orientation is unknown; remove the EXIF data (e.g. re-save the image): {path}") from None


def _open(path: str, mode: str, where: str, decode: bool):
    """decode=False: the header only (format, size, mode), returns the format; else the picture."""
    problem = file_problem(path)
    if problem:
        raise DataError(f"{where}: {problem}: {path}")
    try:
        with Image.open(path) as img:
            if not decode:
                why = _unconvertible(img.mode, mode)  # the mode is in the header: refuse it here already
                if why:
                    raise DataError(f"{where}: cannot convert image mode {img.mode!r} to {mode} ({why}): {path}")
                if img.format in EXIF_IN_HEADER:  # (a PNG's may follow its pixels: found when loaded)
                    _orient(img, path, where, apply=False)
                return img.format
            img.load()  # decode now, so a truncated file fails here with its row and file named
            return to_rgb(_orient(img, path, where), path, where, mode)
    except UnidentifiedImageError:
        raise DataError(f"{where}: not an image (PIL cannot read its format): {path}") from None
    except Image.DecompressionBombError as err:
        raise DataError(f"{where}: {too_large(err)}: {path}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as err:
        raise DataError(f"{where}: unreadable or corrupt image ({one_line(err)}): {path}") from None


def load_image(path, mode: str = "RGB", where: str = "image") -> Image.Image:
    """An image file as the picture a viewer shows: EXIF orientation applied, every PIL mode decoded to 8-bit
    `mode` (RGB by default; RGBA keeps alpha); a failure is one line (`where`: what names the file's place)."""
    return _open(os.fspath(path), mode, where, decode=True)


def image_size(path) -> tuple[int, int] | None:
    """(width, height) as loaded, from the header (EXIF orientations 5-8 stand the picture on its side); None when
    the header cannot tell."""
    try:
        with Image.open(os.fspath(path)) as img:
            size = img.size
            orientation = img.getexif().get(0x0112)  # (a PNG's EXIF after its pixels is not seen here)
    except Exception:  # the check and the load report what is wrong with the file
        return None
    return (size[1], size[0]) if orientation in (5, 6, 7, 8) else size


def check_image(path, mode: str = "RGB", where: str = "image") -> None:
    """Header, mode and the format's end marker: a few hundred bytes per file. A file whose end marker is missing
    (truncated, or trailing bytes after it) is decoded to tell, so the check rejects only what loading rejects."""
    path = os.fspath(path)
    if not _looks_whole(path, _open(path, mode, where, decode=False)):
        _open(path, mode, where, decode=True)


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


def as_image_list(images) -> list:
    """Image(s) as a list, e.g. a clip's frames: a list or tuple as it is, None as none, anything else (one image)
    as a one-item list (a value that is no image is left for the caller to refuse, naming its column)."""
    if images is None:
        return []
    return list(images) if isinstance(images, (list, tuple)) else [images]


def per_sample_images(value, batch_size: int, name: str = "edit_image") -> list[list[Image.Image]] | None:
    """Images per sample: an image or a list of images is every sample's; a list of lists one per sample."""
    from ..errors import UserError

    if value is None:
        return None
    if isinstance(value, Image.Image):
        return [[value]] * batch_size
    items = list(value)
    if items and all(isinstance(i, Image.Image) for i in items):
        return [items] * batch_size
    if len(items) == batch_size and all(isinstance(i, (list, tuple, Image.Image)) for i in items):
        return [[i] if isinstance(i, Image.Image) else list(i) for i in items]
    raise UserError(f"{name} must be an image, a list of images, or one list per prompt (got "
                    f"{type(value).__name__} for {batch_size} prompt(s))")


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
