"""Issue 17: every input read right (image modes, metadata values, URLs, stale or corrupt caches, disk full,
bad rows found before training), and nothing earlier lost."""

import errno
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from PIL import Image

from difftune.data import DataError, LoadImage, ToAbsolutePath, UnifiedDataset

W, H = 64, 16


def ramp(lo, hi, dtype):
    """A horizontal gradient from lo to hi, H rows of W columns."""
    return np.tile(np.linspace(lo, hi, W), (H, 1)).astype(dtype)


def as_rgb(grey):
    grey = np.clip(np.rint(grey), 0, 255).astype(np.uint8)
    return np.stack([grey] * 3, axis=-1)


def loaded(path):
    img = LoadImage()(str(path), {"where": "m.csv row 1", "key": "image"})
    assert img.mode == "RGB"
    return np.asarray(img).astype(int)


def close(got, expected, tol=1):
    diff = np.abs(got.astype(int) - np.asarray(expected).astype(int))
    assert diff.max() <= tol, f"max difference {diff.max()} levels"


# -- 1. images decoded right ----------------------------------------------------------------------------------
def test_16_bit_png_is_scaled_not_white(tmp_path):
    values = ramp(0, 65535, np.uint16)
    Image.fromarray(values).save(tmp_path / "x.png")
    assert Image.open(tmp_path / "x.png").mode == "I;16"
    got = loaded(tmp_path / "x.png")
    close(got, as_rgb(values / 257))
    assert got[0, 0].tolist() == [0, 0, 0] and got[0, -1].tolist() == [255, 255, 255]


def test_32_bit_integer_tiff_by_value_range(tmp_path):
    sixteen = ramp(0, 65535, np.int32)  # 16-bit values held in mode I: scaled like 16-bit
    Image.fromarray(sixteen).save(tmp_path / "i16.tif")
    assert Image.open(tmp_path / "i16.tif").mode == "I"
    close(loaded(tmp_path / "i16.tif"), as_rgb(sixteen / 257))
    wide = ramp(-100000, 300000, np.int32)  # outside 0..65535: stretched from min..max
    Image.fromarray(wide).save(tmp_path / "wide.tif")
    close(loaded(tmp_path / "wide.tif"), as_rgb((wide + 100000) / 400000 * 255))


def test_float_tiff_is_scaled_not_black(tmp_path):
    unit = ramp(0, 1, np.float32)
    Image.fromarray(unit).save(tmp_path / "unit.tif")
    assert Image.open(tmp_path / "unit.tif").mode == "F"
    close(loaded(tmp_path / "unit.tif"), as_rgb(unit * 255))
    eight = ramp(0, 255, np.float32)  # already 0..255: as is
    Image.fromarray(eight).save(tmp_path / "eight.tif")
    close(loaded(tmp_path / "eight.tif"), as_rgb(eight))
    hdr = ramp(-2, 6, np.float32)  # anything else: stretched
    Image.fromarray(hdr).save(tmp_path / "hdr.tif")
    close(loaded(tmp_path / "hdr.tif"), as_rgb((hdr + 2) / 8 * 255))
    nan = unit.copy()
    nan[3, 3] = np.nan
    Image.fromarray(nan).save(tmp_path / "nan.tif")
    with pytest.raises(DataError) as err:
        loaded(tmp_path / "nan.tif")
    assert "m.csv row 1 'image'" in str(err.value) and "NaN" in str(err.value) and "nan.tif" in str(err.value)


def test_alpha_is_composited_on_white(tmp_path):
    alpha = ramp(0, 255, np.uint8)
    rgba = np.zeros((H, W, 4), np.uint8)
    rgba[..., 0] = 200  # (200, 0, 0) at opacity alpha over white
    rgba[..., 3] = alpha
    Image.fromarray(rgba, "RGBA").save(tmp_path / "rgba.png")
    a = alpha / 255.0
    expected = np.stack([200 * a + 255 * (1 - a), 255 * (1 - a), 255 * (1 - a)], axis=-1)
    close(loaded(tmp_path / "rgba.png"), expected)
    la = np.stack([np.full((H, W), 50, np.uint8), alpha], axis=-1)
    Image.fromarray(la, "LA").save(tmp_path / "la.png")
    close(loaded(tmp_path / "la.png"), as_rgb(50 * a + 255 * (1 - a)))


def test_palette_with_transparency_and_one_bit(tmp_path):
    pal = Image.new("P", (W, H), 0)
    pal.putpalette([10, 20, 30, 200, 100, 50] + [0] * 762)
    pal.paste(1, (W // 2, 0, W, H))
    pal.save(tmp_path / "p.png", transparency=0)  # index 0 is transparent: white
    got = loaded(tmp_path / "p.png")
    assert got[0, 0].tolist() == [255, 255, 255] and got[0, -1].tolist() == [200, 100, 50]
    pal.save(tmp_path / "opaque.png")
    assert loaded(tmp_path / "opaque.png")[0, 0].tolist() == [10, 20, 30]
    pal.save(tmp_path / "p.gif", transparency=0)
    assert loaded(tmp_path / "p.gif")[0, 0].tolist() == [255, 255, 255]
    bits = Image.fromarray(ramp(0, 255, np.uint8) > 127).convert("1")
    bits.save(tmp_path / "b.png")
    assert Image.open(tmp_path / "b.png").mode == "1"
    close(loaded(tmp_path / "b.png"), as_rgb((ramp(0, 255, np.uint8) > 127) * 255), tol=0)
    grey = ramp(0, 255, np.uint8)
    Image.fromarray(grey).save(tmp_path / "l.png")
    close(loaded(tmp_path / "l.png"), as_rgb(grey), tol=0)


def test_cmyk_and_lab_files(tmp_path):
    cmyk = Image.new("CMYK", (W, H), (0, 255, 255, 0))  # magenta + yellow ink: red
    cmyk.paste((0, 0, 0, 255), (W // 2, 0, W, H))  # black ink
    cmyk.save(tmp_path / "c.tif")
    cmyk.save(tmp_path / "c.jpg", quality=100)
    for name in ("c.tif", "c.jpg"):
        got = loaded(tmp_path / name)
        close(got[0, 2], [255, 0, 0], tol=2)
        close(got[0, -2], [0, 0, 0], tol=2)
    Image.new("LAB", (W, H), (255, 128, 128)).save(tmp_path / "lab.tif")  # L*=100, a*=b*=0: white
    assert Image.open(tmp_path / "lab.tif").mode == "LAB"
    close(loaded(tmp_path / "lab.tif"), np.full((H, W, 3), 255), tol=2)


def test_in_memory_modes_convert():
    from difftune.data.operators import to_rgb

    ycc = Image.new("RGB", (4, 4), (30, 120, 220)).convert("YCbCr")
    close(np.asarray(to_rgb(ycc)), np.full((4, 4, 3), (30, 120, 220)), tol=2)
    hsv = Image.new("HSV", (4, 4), (0, 255, 255))  # hue 0, full saturation and value: red
    close(np.asarray(to_rgb(hsv)), np.full((4, 4, 3), (255, 0, 0)), tol=1)
    premultiplied = Image.new("RGBA", (4, 4), (200, 0, 0, 128)).convert("RGBa")
    close(np.asarray(to_rgb(premultiplied)), np.full((4, 4, 3), (227, 127, 127)), tol=2)
    la = Image.new("LA", (4, 4), (0, 128)).convert("La")
    close(np.asarray(to_rgb(la)), np.full((4, 4, 3), 127), tol=2)
    assert to_rgb(Image.new("I;16B", (2, 2), 65535)).getpixel((0, 0)) == (255, 255, 255)


def test_exif_orientation_is_applied(tmp_path):
    img = Image.new("RGB", (40, 20), (0, 0, 255))
    img.paste((255, 0, 0), (0, 0, 10, 10))  # red: top-left as stored
    exif = Image.Exif()
    exif[0x0112] = 6  # stored rotated: the viewer turns it 90 degrees clockwise
    img.save(tmp_path / "rot.png", exif=exif)
    got = LoadImage()(str(tmp_path / "rot.png"))
    assert got.size == (20, 40)
    assert got.getpixel((15, 5)) == (255, 0, 0) and got.getpixel((5, 5)) == (0, 0, 255)  # red now top-right


def test_unconvertible_mode_is_refused_in_one_line(tmp_path, monkeypatch):
    Image.new("CMYK", (8, 8)).save(tmp_path / "odd.tif")
    real = Image.Image.convert

    def convert(self, mode=None, *a, **k):
        if self.mode == "CMYK":
            raise ValueError("conversion from CMYK to RGB not supported")
        return real(self, mode, *a, **k)

    monkeypatch.setattr(Image.Image, "convert", convert)
    import difftune.data.operators as ops

    ops._unconvertible.cache_clear()
    try:
        context = {"where": "m.csv row 4", "key": "image"}
        for step in (LoadImage(), LoadImage().check):  # the cheap check refuses it from the header already
            with pytest.raises(DataError) as err:
                step(str(tmp_path / "odd.tif"), dict(context))
            text = str(err.value)
            assert "\n" not in text and "m.csv row 4 'image'" in text and "'CMYK'" in text and "odd.tif" in text
    finally:
        ops._unconvertible.cache_clear()


def test_check_is_header_only_and_accepts_every_mode(tmp_path):
    for mode in ("I;16", "F", "RGBA", "LA", "P", "1", "CMYK", "L"):
        arr = ramp(0, 1, np.float32) if mode == "F" else ramp(0, 255, np.uint8)
        img = Image.fromarray(arr).convert(mode) if mode != "I;16" else Image.fromarray(ramp(0, 65535, np.uint16))
        path = tmp_path / f"x{mode.replace(';', '_')}.{'tif' if mode in ('F', 'CMYK') else 'png'}"
        img.save(path)
        assert LoadImage().check(str(path)) is not None
