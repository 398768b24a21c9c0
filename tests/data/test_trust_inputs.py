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
import torch
from PIL import Image

from conftest import noise_image
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
    from difftune.media.image import to_rgb

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


def test_unparsable_exif_is_refused_in_one_line(tmp_path, monkeypatch):
    import struct

    from PIL import ImageOps

    Image.new("RGB", (8, 8)).save(tmp_path / "e.jpg")

    def broken(*a, **k):
        raise struct.error("unpack requires a buffer of 4 bytes")

    monkeypatch.setattr(ImageOps, "exif_transpose", broken)
    monkeypatch.setattr(Image.Image, "getexif", broken)
    for step in (LoadImage(), LoadImage().check):  # found by the cheap check too: EXIF is in the header
        with pytest.raises(DataError) as err:
            step(str(tmp_path / "e.jpg"), {"where": "m.csv row 2", "key": "image"})
        text = str(err.value)
        assert "\n" not in text and "m.csv row 2 'image'" in text and "EXIF" in text and "e.jpg" in text


def test_unconvertible_mode_is_refused_in_one_line(tmp_path, monkeypatch):
    Image.new("CMYK", (8, 8)).save(tmp_path / "odd.tif")
    real = Image.Image.convert

    def convert(self, mode=None, *a, **k):
        if self.mode == "CMYK":
            raise ValueError("conversion from CMYK to RGB not supported")
        return real(self, mode, *a, **k)

    monkeypatch.setattr(Image.Image, "convert", convert)
    import difftune.media.image as ops

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


# -- 2. metadata read as the user means it --------------------------------------------------------------------
def picture(folder, name="a.png", color=(200, 30, 30)):
    folder.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (32, 32), color).save(folder / name)
    return name


def test_metadata_without_prompt_column_is_refused(tmp_path):
    picture(tmp_path)
    meta = tmp_path / "m.csv"
    meta.write_text("image,caption\na.png,a red square\n")
    with pytest.raises(DataError) as err:
        UnifiedDataset(tmp_path, meta)
    text = str(err.value)
    assert "\n" not in text and str(meta) in text and "no 'prompt' column" in text
    assert "its columns are image, caption" in text and "--allow_empty_prompts" in text
    ds = UnifiedDataset(tmp_path, meta, allow_empty_prompts=True)  # empty prompts meant: as before
    assert "prompt" not in ds[0] and ds[0]["caption"] == "a red square"


def test_cli_refuses_metadata_without_prompts(tmp_path, tiny_repo, capsys):
    from test_bad_input import base_args, cli, one_line_error

    picture(tmp_path / "data")
    meta = tmp_path / "data" / "metadata.csv"
    meta.write_text("image,caption\na.png,a red square\n")
    one_line_error(capsys, cli(*base_args(meta, tmp_path / "out", tiny_repo)), "metadata.csv", "no 'prompt' column",
                   "image, caption")
    assert not (tmp_path / "out").exists() or not list((tmp_path / "out").glob("*.safetensors"))


@pytest.mark.parametrize("fmt", ["csv", "jsonl", "json"])
def test_prompts_that_look_like_numbers_stay_text(tmp_path, fmt):
    picture(tmp_path)
    rows = [{"image": "a.png", "prompt": 1984, "negative_prompt": False, "seed": 7, "scale": 1.5, "flag": True},
            {"image": "a.png", "prompt": 2001, "negative_prompt": True, "seed": 8, "scale": 2.5, "flag": False}]
    meta = tmp_path / f"m.{fmt}"
    if fmt == "csv":
        meta.write_text("image,prompt,negative_prompt,seed,scale,flag\n"
                        "a.png,1984,False,7,1.5,True\na.png,2001,True,8,2.5,false\n")
        texts = [("1984", "False"), ("2001", "True")]
    else:
        body = json.dumps(rows) if fmt == "json" else "\n".join(json.dumps(r) for r in rows)
        meta.write_text(body + "\n")
        texts = [("1984", "false"), ("2001", "true")]  # as typed in the file
    ds = UnifiedDataset(tmp_path, meta)
    for i, (prompt, negative) in enumerate(texts):
        item = ds[i]
        assert item["prompt"] == prompt and item["negative_prompt"] == negative
        assert type(item["seed"]) is int and item["seed"] == 7 + i  # numbers where numbers are meant
        assert item["scale"] == 1.5 + i and item["flag"] is (i == 0)


def test_training_on_numeric_prompts_runs(tmp_path, tiny_repo, capsys):
    from test_bad_input import base_args, cli

    data = tmp_path / "data"
    picture(data, "a.png")
    picture(data, "b.png", (30, 30, 200))
    meta = data / "metadata.csv"
    meta.write_text("image,prompt\na.png,1984\nb.png,2001\n")  # was: TypeError: 'int' object is not iterable
    assert cli(*base_args(meta, tmp_path / "out", tiny_repo), "--max_steps", 1) == 0
    assert list((tmp_path / "out").glob("*.safetensors"))


# -- 3. URLs in metadata --------------------------------------------------------------------------------------
def test_urls_are_refused_by_name(tmp_path):
    picture(tmp_path)
    url = "https://example.com/pictures/b.png"
    meta = tmp_path / "m.jsonl"
    meta.write_text(json.dumps({"image": "a.png", "prompt": "p"}) + "\n" + json.dumps({"image": url, "prompt": "q"}))
    with pytest.raises(DataError) as err:
        UnifiedDataset(tmp_path, meta)
    text = str(err.value)
    assert "\n" not in text and "m.jsonl row 2 'image'" in text and url in text
    assert "URLs are not downloaded" in text and "file not found" not in text
    with pytest.raises(DataError, match="URLs are not downloaded"):
        ToAbsolutePath(tmp_path)("HTTP://example.com/x.png")
    assert ToAbsolutePath(tmp_path)("sub/x.png") == str(tmp_path / "sub" / "x.png")


# -- 7. bad data found in seconds -----------------------------------------------------------------------------
def many_rows(folder, n, last=None):
    """n rows over two pictures; the last row's image replaced by `last` ('missing' or 'truncated')."""
    picture(folder, "a.png")
    picture(folder, "b.png", (30, 30, 200))
    names = ["a.png" if i % 2 else "b.png" for i in range(n)]
    if last == "missing":
        names[-1] = "gone.png"
    elif last == "truncated":
        noise_image((64, 64), 40, seed=1).save(folder / "full.png")
        (folder / "cut.png").write_bytes((folder / "full.png").read_bytes()[:3000])
        names[-1] = "cut.png"
    meta = folder / "metadata.csv"
    meta.write_text("image,prompt\n" + "".join(f"{name},picture {i}\n" for i, name in enumerate(names)))
    return meta


@pytest.mark.parametrize("last", ["missing", "truncated"])
def test_bad_last_row_stops_before_the_first_step(tmp_path, tiny_repo, capsys, last):
    from test_bad_input import base_args, cli, one_line_error

    meta = many_rows(tmp_path / "data", 40, last)
    out = tmp_path / "out"
    name = "gone.png" if last == "missing" else "cut.png"
    one_line_error(capsys, cli(*base_args(meta, out, tiny_repo), "--save_steps", 1), "metadata.csv row 40 'image'",
                   name, "file not found" if last == "missing" else "corrupt")
    assert not out.exists() or not list(out.rglob("*.safetensors"))  # no step was trained
    cache = tmp_path / "cache"  # stage 1 too: before any sample is encoded
    one_line_error(capsys, cli(*base_args(meta, cache, tiny_repo), "--task", "sft:data_process"), "row 40", name)
    assert not cache.exists() or not list(cache.rglob("*.safetensors"))


def test_precheck_counts_every_bad_row_and_shows_progress(tmp_path, capsys, monkeypatch):
    import difftune.data.dataset as dataset

    meta = many_rows(tmp_path, 30)
    text = meta.read_text().replace("a.png,picture 3", "x.png,picture 3").replace("b.png,picture 8", "y.png,picture 8")
    meta.write_text(text)
    with pytest.raises(DataError) as err:
        UnifiedDataset(tmp_path, meta, progress=False)
    assert str(err.value) == f"{meta} row 4 'image': file not found: {tmp_path / 'x.png'} (and 1 more bad row)"
    assert capsys.readouterr().err == ""
    monkeypatch.setattr(dataset, "PROGRESS_ROWS", 10)
    ds = UnifiedDataset(tmp_path, meta, on_bad_sample="skip")
    assert ds.num_rows == 28 and [b["row"] for b in ds.bad_samples] == [4, 9]
    assert "checking metadata.csv" in capsys.readouterr().err
    UnifiedDataset(tmp_path, meta, on_bad_sample="skip", progress=False)
    assert capsys.readouterr().err == ""


# -- 6. disk full / file-size limit while saving --------------------------------------------------------------
FSIZE_SCRIPT = textwrap.dedent("""
    import json, resource, signal, sys
    from pathlib import Path
    import torch
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # else the kernel kills the process at the limit
    folder = Path(sys.argv[1])
    for name in ("a.txt", "b.safetensors", "c.json"):
        (folder / name).write_text("old content")
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))
    from difftune.cache.manifest import atomic_write_bytes
    from difftune.errors import UserError
    from difftune.io import atomic_save_safetensors, atomic_write_text
    from difftune.cache import CacheManifest, CacheWriter
    writes = {"a.txt": lambda p: atomic_write_text(p, "x" * 10000),
              "b.safetensors": lambda p: atomic_save_safetensors({"w": torch.zeros(5000)}, p),
              "c.json": lambda p: atomic_write_bytes(p, b"y" * 9000)}
    out = {}
    for name, write in writes.items():
        try:
            write(folder / name)
            out[name] = "no error"
        except UserError as err:
            out[name] = str(err)
    manifest = CacheManifest.new(family="toy", fingerprint={"x": 1})
    writer = CacheWriter(folder / "cache", manifest=manifest)
    writer.write("s1", {"latents": torch.zeros(4000)})
    try:
        writer.flush()
        out["shard"] = "no error"
    except UserError as err:
        out["shard"] = str(err)
    print(json.dumps(out))
""")


def test_file_size_limit_is_one_line_and_keeps_the_old_file(tmp_path):
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    run = subprocess.run([sys.executable, "-c", FSIZE_SCRIPT, str(tmp_path)], capture_output=True, text=True, env=env,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout.strip().splitlines()[-1])
    sizes = {"a.txt": "10000 bytes", "b.safetensors": "20000 bytes", "c.json": "9000 bytes"}
    for name, size in sizes.items():
        assert out[name].startswith(f"cannot write {tmp_path / name}: file too large"), out[name]
        assert size in out[name] and "\n" not in out[name]
        assert (tmp_path / name).read_text() == "old content"  # the earlier file, untouched
    assert "shard-000000.safetensors" in out["shard"] and "file too large" in out["shard"]
    assert "16000 bytes" in out["shard"]
    leftovers = [p.name for p in tmp_path.rglob("*") if ".tmp" in p.name]
    assert leftovers == []


def test_disk_full_while_saving_a_checkpoint(tmp_path, tiny_repo, capsys, monkeypatch):
    import safetensors.torch

    from conftest import make_image_dataset
    from test_bad_input import base_args, cli, one_line_error

    meta = make_image_dataset(tmp_path / "data", n=2)
    out = tmp_path / "out"
    assert cli(*base_args(meta, out, tiny_repo)) == 0
    capsys.readouterr()
    before = (out / "epoch-0.safetensors").read_bytes()
    real = safetensors.torch.save_file

    def full_disk(tensors, filename, metadata=None):
        real(tensors, filename, metadata)  # the bytes go out, then the device is full
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(safetensors.torch, "save_file", full_disk)
    line = one_line_error(capsys, cli(*base_args(meta, out, tiny_repo)), str(out / "epoch-0.safetensors"),
                          "no space left on the device", "bytes")
    assert "previous file" in line
    assert (out / "epoch-0.safetensors").read_bytes() == before
    assert [p.name for p in out.iterdir() if ".tmp" in p.name] == []


def test_disk_full_while_writing_the_cache(tmp_path, tiny_repo, capsys, monkeypatch):
    import difftune.cache.writer as store
    from conftest import make_image_dataset
    from test_bad_input import base_args, cli, one_line_error

    def full_disk(tensors, filename, metadata=None):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(store, "save_file", full_disk)
    meta = make_image_dataset(tmp_path / "data", n=2)
    cache = tmp_path / "cache"
    one_line_error(capsys, cli(*base_args(meta, cache, tiny_repo), "--task", "sft:data_process"),
                   "shard-000000.safetensors", "no space left on the device")
    assert [p.name for p in cache.rglob("*") if ".tmp" in p.name] == []


# -- 5. a corrupt cache shard ---------------------------------------------------------------------------------
def flip_tensor_bytes(shard):
    """Flip 8 bytes in the middle of the largest tensor's data (the header stays valid)."""
    data = bytearray(shard.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    start, end = max((v["data_offsets"] for k, v in header.items() if k != "__metadata__"), key=lambda o: o[1] - o[0])
    at = 8 + n + (start + end) // 2
    data[at:at + 8] = bytes(b ^ 0x5A for b in data[at:at + 8])
    shard.write_bytes(bytes(data))


def test_corrupt_shard_stops_stage_2_in_one_line(tmp_path, tiny_repo, capsys):
    from conftest import make_image_dataset
    from test_bad_input import cli, one_line_error, stage1_cache, stage2_args

    meta = make_image_dataset(tmp_path / "data", n=2)
    cache = stage1_cache(meta, tmp_path / "cache", tiny_repo, capsys)
    shard = cache / "part-00000" / "shard-000000.safetensors"
    flip_tensor_bytes(shard)
    out = tmp_path / "out"
    one_line_error(capsys, cli(*stage2_args(cache, out, tiny_repo)), str(shard), "corrupt",
                   f"difftune cache verify {cache}")
    assert not list(out.glob("*.safetensors"))


def test_cache_reader_checks_each_tensor_once(tmp_path, monkeypatch):
    import torch

    import difftune.cache.reader as store
    from difftune.cache import CacheManifest, CacheReader, CacheWriter

    with CacheWriter(tmp_path / "c", manifest=CacheManifest.new(family="toy", fingerprint={})) as writer:
        writer.write("a", {"x": torch.arange(1000.0), "y": [torch.ones(3), 2]})
        writer.write("b", {"x": torch.zeros(1000), "y": [torch.ones(3), 3]})
    reader = CacheReader(tmp_path / "c")
    calls = []
    real = store.tensor_sha256
    monkeypatch.setattr(store, "tensor_sha256", lambda t: calls.append(t.numel()) or real(t))
    assert reader[0]["x"].sum() == 499500 and reader[0]["y"][1] == 2
    reader[0], reader[1]
    assert sorted(calls) == [3, 3, 1000, 1000]  # each tensor hashed on its first read only
    flip_tensor_bytes(tmp_path / "c" / "part-00000" / "shard-000000.safetensors")
    fresh = CacheReader(tmp_path / "c")
    with pytest.raises(DataError) as err:
        [fresh[i] for i in range(2)]
    assert "shard-000000.safetensors is corrupt" in str(err.value) and "\n" not in str(err.value)


# -- 4. a stale cache -----------------------------------------------------------------------------------------
def recolour(path, color):
    Image.new("RGB", (64, 48), color).save(path)


def latents(cache):
    from difftune.cache import CacheReader

    reader = CacheReader(cache, log=None)
    return {reader.ids[i]: {k: v for k, v in reader[i].items() if hasattr(v, "shape")} for i in range(len(reader))}


def test_stage1_rerun_encodes_replaced_images_again(tmp_path, tiny_repo, capsys):
    import torch

    from conftest import make_image_dataset
    from difftune.cache import verify_cache
    from test_bad_input import base_args, cli, stage2_args

    meta = make_image_dataset(tmp_path / "data", n=4)
    cache = tmp_path / "cache"
    assert cli(*base_args(meta, cache, tiny_repo), "--task", "sft:data_process") == 0
    before = latents(cache)
    recolour(meta.parent / "image_2.png", (10, 240, 10))  # replaced after stage 1, metadata unchanged
    recolour(meta.parent / "image_4.png", (240, 240, 240))
    capsys.readouterr()
    assert cli(*base_args(meta, cache, tiny_repo), "--task", "sft:data_process") == 0
    said = capsys.readouterr().out
    assert "2 sample(s) already cached" in said and "4 sample(s) already cached" not in said
    assert "encoding 2 cached sample(s) again" in said and "image_2.png" in said
    after = latents(cache)
    fresh_cache = tmp_path / "fresh"
    assert cli(*base_args(meta, fresh_cache, tiny_repo), "--task", "sft:data_process") == 0
    fresh = latents(fresh_cache)
    ids = sorted(before)
    assert sorted(after) == ids == sorted(fresh)
    for n, sample_id in enumerate(ids):
        for name in fresh[sample_id]:
            assert torch.equal(after[sample_id][name], fresh[sample_id][name]), (sample_id, name)
        changed = any(not torch.equal(before[sample_id][k], after[sample_id][k]) for k in before[sample_id])
        assert changed == (n in (1, 3)), sample_id
    report = verify_cache(cache)
    assert report.ok, str(report)
    assert report.samples == 4
    capsys.readouterr()
    assert cli(*base_args(meta, cache, tiny_repo), "--task", "sft:data_process") == 0  # nothing left to do
    assert "4 sample(s) already cached" in capsys.readouterr().out
    assert cli(*stage2_args(cache, tmp_path / "out", tiny_repo)) == 0


def test_cache_of_another_data_folder_is_refused(tmp_path, tiny_repo, capsys):
    import shutil

    from conftest import make_image_dataset
    from test_bad_input import base_args, cli, one_line_error

    meta = make_image_dataset(tmp_path / "data", n=2)
    cache = tmp_path / "cache"
    assert cli(*base_args(meta, cache, tiny_repo), "--task", "sft:data_process") == 0
    shutil.copytree(meta.parent, tmp_path / "other")
    recolour(tmp_path / "other" / "image_1.png", (1, 2, 3))  # same metadata, other pictures
    capsys.readouterr()
    one_line_error(capsys, cli(*base_args(tmp_path / "other" / "metadata.csv", cache, tiny_repo), "--task",
                               "sft:data_process"), "data_root", "--rebuild_cache")


def test_stage2_refuses_changed_sources_and_notes_absent_ones(tmp_path, tiny_repo, capsys):
    from conftest import make_image_dataset
    from test_bad_input import base_args, cli, one_line_error, stage2_args

    meta = make_image_dataset(tmp_path / "data", n=2)
    cache = tmp_path / "cache"
    assert cli(*base_args(meta, cache, tiny_repo), "--task", "sft:data_process") == 0
    image = meta.parent / "image_2.png"
    original = image.read_bytes()
    os.utime(image, ns=(1, 1))  # touched (or copied): same content, so still fine
    capsys.readouterr()
    assert cli(*stage2_args(cache, tmp_path / "out1", tiny_repo)) == 0
    assert "note:" not in capsys.readouterr().out
    recolour(image, (0, 0, 0))
    one_line_error(capsys, cli(*stage2_args(cache, tmp_path / "out2", tiny_repo)), str(cache), str(image),
                   "changed after stage 1")
    assert not list((tmp_path / "out2").glob("*.safetensors"))
    image.write_bytes(original)  # put back: size and sampled content as recorded
    assert cli(*stage2_args(cache, tmp_path / "out3", tiny_repo)) == 0
    capsys.readouterr()
    meta.parent.rename(tmp_path / "elsewhere")  # the cache carried to a machine without the data set
    assert cli(*stage2_args(cache, tmp_path / "out4", tiny_repo)) == 0
    said = capsys.readouterr().out
    assert "note: 2 of the 2 source files" in said and "not on this machine" in said and "image_1.png" in said
    assert list((tmp_path / "out4").glob("*.safetensors"))


# -- .pth weight files (Wan-AI ships its T5, VAE and CLIP weights so) ------------------------------------

def test_a_pth_state_dict_reads_like_safetensors(tmp_path):
    from difftune.models.detect import read_header
    from difftune.models.files import iter_tensors

    state = {"a.weight": torch.randn(3, 2), "b.bias": torch.arange(4, dtype=torch.bfloat16)}
    torch.save(state, tmp_path / "w.pth")
    assert read_header(tmp_path / "w.pth") == {"a.weight": (3, 2), "b.bias": (4,)}
    back = dict(iter_tensors(tmp_path / "w.pth"))
    assert back.keys() == state.keys() and all(torch.equal(back[k], state[k]) for k in state)


class _Payload:
    def __reduce__(self):
        import os

        return (os.system, ("echo pwned > /dev/null",))


@pytest.mark.parametrize("content", [{"w": _Payload()}, {"w": torch.zeros(1), "step": 3}, [torch.zeros(1)]],
                         ids=["code", "not-a-tensor", "not-a-dict"])
def test_a_pth_that_is_not_a_plain_state_dict_is_refused_in_one_line(tmp_path, content):
    from difftune.errors import UserError
    from difftune.models.detect import read_header

    torch.save(content, tmp_path / "bad.pth")
    with pytest.raises(UserError) as err:
        read_header(tmp_path / "bad.pth")
    assert "bad.pth" in str(err.value) and "\n" not in str(err.value)


def test_other_pickle_suffixes_stay_refused(tmp_path):
    from difftune.errors import UserError
    from difftune.models.detect import read_header

    torch.save({"w": torch.zeros(1)}, tmp_path / "model.ckpt")
    with pytest.raises(UserError, match="refusing to load a pickle"):
        read_header(tmp_path / "model.ckpt")
