"""UnifiedDataset and its operators: metadata formats, resizing, error messages, workers, skipping."""

import json
import os
import pickle

import pytest
from PIL import Image
from torch.utils.data import DataLoader

from conftest import noise_image
from difftune.data import (DataError, ImageCropAndResize, Lambda, LoadImage, RouteByExtension, ToAbsolutePath,
                           UnifiedDataset, read_metadata, target_size)
from difftune.errors import UserError
from support import write_example_dataset

ROWS = [{"image": "a.png", "prompt": "a dog", "seed": 1},
        {"image": "b.png", "prompt": "a cat, sitting", "seed": 22},
        {"image": "c.png", "prompt": "007", "seed": 333}]


def halves(path, size=(200, 100)):
    """Left half red, right half blue: shows where a crop came from."""
    img = Image.new("RGB", size, (255, 0, 0))
    img.paste((0, 0, 255), (size[0] // 2, 0, size[0], size[1]))
    img.save(path)
    return path


def write_metadata(path, rows):
    if path.suffix == ".csv":
        cols = list(dict.fromkeys(c for r in rows for c in r))
        lines = [",".join(cols)] + [",".join(json.dumps(str(r.get(c, ""))) if c == "prompt" else str(r.get(c, ""))
                                              for c in cols) for r in rows]
        path.write_text("\n".join(lines) + "\n")
    elif path.suffix == ".json":
        path.write_text(json.dumps(rows))
    else:
        path.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    return path


@pytest.fixture()
def data(tmp_path):
    for i, name in enumerate(("a.png", "b.png", "c.png")):
        Image.new("RGB", (64 + 16 * i, 48), (40 * i, 100, 200)).save(tmp_path / name)
    return tmp_path


def one_line_error(excinfo, *parts):
    text = str(excinfo.value)
    assert "\n" not in text, text
    for part in parts:
        assert str(part) in text, (part, text)
    return text


# -- metadata -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", ["csv", "json", "jsonl"])
def test_metadata_round_trip(data, fmt):
    meta = write_metadata(data / f"metadata.{fmt}", ROWS)
    ds = UnifiedDataset(data, meta)
    assert len(ds) == 3
    for i, row in enumerate(ROWS):
        item = ds[i]
        assert {k: item[k] for k in ("prompt", "seed")} == {"prompt": row["prompt"], "seed": row["seed"]}
        assert type(item["seed"]) is int and item["prompt"] == row["prompt"]  # "007" stays a string
        assert isinstance(item["image"], Image.Image) and item["image"].mode == "RGB"
        assert item["image"].size == (64 + 16 * i, 48)
        assert item["_row"] == i and item["_id"].startswith(f"{i:06d}-")
    ids = [ds[i]["_id"] for i in range(3)]
    # the id depends on the row's content only, so it is the same in every format and every run
    other = write_metadata(data / "again.jsonl", ROWS)
    assert [UnifiedDataset(data, other).sample_id(i) for i in range(3)] == ids
    changed = write_metadata(data / "changed.jsonl", [ROWS[0], {**ROWS[1], "prompt": "a cow"}, ROWS[2]])
    changed_ids = [UnifiedDataset(data, changed).sample_id(i) for i in range(3)]
    assert changed_ids[0] == ids[0] and changed_ids[1] != ids[1]
    twins = UnifiedDataset(data, write_metadata(data / "twins.json", [ROWS[0]] * 3), repeat=2)
    assert len({twins.sample_id(i) for i in range(3)}) == 3  # identical rows still get distinct ids
    assert [twins.sample_id(i) for i in range(6)] == [twins.sample_id(i) for i in range(3)] * 2


def test_csv_values_keep_their_meaning(tmp_path):
    meta = tmp_path / "m.csv"
    meta.write_text('\ufeffimage, prompt,seed,scale,flag,note\n'
                    '1.png,"a, b",5,1.5,True,None\n'
                    '2.png,123,-7,2,false,\n')
    rows = read_metadata(meta, text_columns=["image"])
    assert rows == [{"image": "1.png", "prompt": "a, b", "seed": 5, "scale": 1.5, "flag": True, "note": "None"},
                    {"image": "2.png", "prompt": "123", "seed": -7, "scale": 2.0, "flag": False, "note": None}]


def test_repeat_and_string_keys(data):
    meta = write_metadata(data / "m.csv", [{**r, "mask": "a.png"} for r in ROWS])
    ds = UnifiedDataset(str(data), str(meta), repeat=4, data_file_keys="image")
    assert len(ds) == 12 and ds.num_rows == 3
    assert [ds[i]["_row"] for i in range(12)] == [0, 1, 2] * 4
    assert ds[7]["_id"] == ds[1]["_id"] and ds.sample_id(7) == ds[1]["_id"]
    assert ds[0]["mask"] == "a.png"  # not a listed file key: left as text
    ds = UnifiedDataset(data, meta, data_file_keys=" image , mask ")  # not iterated character by character
    assert isinstance(ds[0]["mask"], Image.Image)


def test_extra_inputs_that_are_files_are_loaded(data):
    rows = [{**r, "edit_image": "c.png", "strength": 0.5} for r in ROWS]
    meta = write_metadata(data / "m.json", rows)
    ds = UnifiedDataset(data, meta, data_file_keys=["image"], extra_inputs="edit_image,strength")
    item = ds[0]
    assert isinstance(item["edit_image"], Image.Image) and item["edit_image"].size == (96, 48)
    assert item["strength"] == 0.5
    csv = write_metadata(data / "m.csv", rows)
    item = UnifiedDataset(data, csv, extra_inputs="edit_image,seed")[2]
    assert isinstance(item["edit_image"], Image.Image) and item["seed"] == 333  # a number, not "333"
    many = write_metadata(data / "many.json", [{**ROWS[0], "edit_image": ["a.png", "b.png"]}])
    item = UnifiedDataset(data, many, extra_inputs=["edit_image"])[0]
    assert [im.size for im in item["edit_image"]] == [(64, 48), (80, 48)]
    with pytest.raises(DataError) as err:
        UnifiedDataset(data, meta, extra_inputs="edit_image,control_image")
    one_line_error(err, "m.json", "control_image", "--extra_inputs")


def test_present_keys_only_and_special_operators(data):
    meta = write_metadata(data / "m.csv", ROWS)
    ds = UnifiedDataset(data, meta, data_file_keys="image,video", present_keys_only=True,
                        special_operator_map={"image": [ToAbsolutePath(data), LoadImage("L")]})
    assert ds.data_file_keys == ["image"] and ds[0]["image"].mode == "L"


# -- resizing -------------------------------------------------------------------------------------------
@pytest.mark.parametrize("size,max_pixels,factor,expected", [
    ((1000, 600), 262144, 16, (656, 384)),   # scale 1/sqrt(600000/262144): 660x396, floored to 16
    ((600, 1000), 262144, 16, (384, 656)),
    ((1000, 600), 262144, 32, (640, 384)),
    ((3000, 2000), 1048576, 16, (1248, 832)),
    ((1024, 1024), 1048576, 16, (1024, 1024)),
    ((100, 60), 262144, 16, (96, 48)),       # small: never scaled up, only floored
    ((37, 300), 1048576, 8, (32, 296)),
])
def test_dynamic_resolution_sizes(tmp_path, size, max_pixels, factor, expected):
    assert target_size(*size, None, None, max_pixels, factor, factor) == expected
    Image.new("RGB", size, (1, 2, 3)).save(tmp_path / "x.png")
    write_metadata(tmp_path / "m.csv", [{"image": "x.png", "prompt": "p"}])
    op = UnifiedDataset.default_image_operator(tmp_path, max_pixels=max_pixels, height_division_factor=factor,
                                               width_division_factor=factor)
    out = UnifiedDataset(tmp_path, tmp_path / "m.csv", main_data_operator=op)[0]["image"]
    assert out.size == expected
    assert out.width <= size[0] and out.height <= size[1]


def thirds(size):
    """Red | green | blue vertical thirds (or horizontal ones for a tall image)."""
    w, h = size
    img = Image.new("RGB", size, (255, 0, 0))
    if w >= h:
        img.paste((0, 255, 0), (w // 3, 0, 2 * w // 3, h))
        img.paste((0, 0, 255), (2 * w // 3, 0, w, h))
    else:
        img.paste((0, 255, 0), (0, h // 3, w, 2 * h // 3))
        img.paste((0, 0, 255), (0, 2 * h // 3, w, h))
    return img


@pytest.mark.parametrize("size,height,width", [((300, 100), 100, 100), ((600, 200), 64, 64), ((100, 300), 50, 50),
                                               ((150, 50), 100, 100)])
def test_fixed_size_keeps_exactly_the_centre(size, height, width):
    """Scale to cover, centre-crop: a square crop of a 3:1 image is its middle third, nothing else."""
    out = ImageCropAndResize(height=height, width=width)(thirds(size))
    assert out.size == (width, height)
    if size[0] == 3 * width:  # no resampling: exactly the middle third
        assert set(out.getdata()) == {(0, 255, 0)}
    # resampling blends the crop's outermost pixels with the neighbouring thirds, no more than that
    tall = size[1] > size[0]
    inner = out.crop((0, 2, width, height - 2) if tall else (2, 0, width - 2, height))
    assert set(inner.getdata()) == {(0, 255, 0)}
    assert all(g >= 128 and g > r and g > b for r, g, b in out.getdata())


def test_fixed_size_covers_and_centre_crops(tmp_path):
    halves(tmp_path / "h.png", (200, 100))
    op = ImageCropAndResize(height=100, width=100)
    out = op(Image.open(tmp_path / "h.png").convert("RGB"))
    assert out.size == (100, 100)
    assert out.getpixel((10, 50)) == (255, 0, 0) and out.getpixel((90, 50)) == (0, 0, 255)
    big = op(Image.new("RGB", (40, 30)))  # fixed sizes do scale up (cover)
    assert big.size == (100, 100)
    tall = ImageCropAndResize(height=64, width=32)(Image.open(tmp_path / "h.png").convert("RGB"))
    assert tall.size == (32, 64)
    assert tall.getpixel((2, 30))[0] > 200 and tall.getpixel((29, 30))[2] > 200  # centre: the red/blue seam
    frames = op([Image.new("RGB", (300, 200))] * 3)  # a video: a list of frames
    assert [f.size for f in frames] == [(100, 100)] * 3
    with pytest.raises(UserError, match="--height and --width"):
        ImageCropAndResize(height=100)


def test_operators_compose_and_route_by_extension(tmp_path):
    halves(tmp_path / "h.png")
    load = ToAbsolutePath(tmp_path) >> LoadImage()
    assert load("h.png").size == (200, 100)
    # a "video" route added without touching the rest: frames flow through the same resize
    frames = Lambda(lambda path: [Image.open(path).convert("RGB")] * 2)
    routed = [ToAbsolutePath(tmp_path), RouteByExtension({".png": LoadImage(), (".frames",): frames}),
              ImageCropAndResize(height=32, width=32)]
    (tmp_path / "clip.frames").write_bytes((tmp_path / "h.png").read_bytes())
    write_metadata(tmp_path / "m.jsonl", [{"image": "h.png", "prompt": "p"}, {"image": "clip.frames", "prompt": "q"}])
    ds = UnifiedDataset(tmp_path, tmp_path / "m.jsonl", main_data_operator=routed)
    assert ds[0]["image"].size == (32, 32)
    assert [f.size for f in ds[1]["image"]] == [(32, 32)] * 2


# -- errors ---------------------------------------------------------------------------------------------
def bad_file(tmp_path, kind):
    good = noise_image((64, 64), 40, seed=1)
    if kind == "missing":
        return "nothere.png", "file not found"
    if kind == "empty":
        (tmp_path / "empty.png").write_bytes(b"")
        return "empty.png", "0 bytes"
    if kind == "text":
        (tmp_path / "notes.png").write_text("these are not pixels")
        return "notes.png", "not an image"
    if kind == "corrupt":
        good.save(tmp_path / "full.png")
        data = (tmp_path / "full.png").read_bytes()
        (tmp_path / "cut.png").write_bytes(data[: len(data) // 2])
        return "cut.png", "corrupt"
    if kind == "truncated_jpeg":  # passes the cheap header check, fails to decode
        good.save(tmp_path / "full.jpg", quality=95)
        data = (tmp_path / "full.jpg").read_bytes()
        (tmp_path / "cut.jpg").write_bytes(data[: len(data) // 2])
        return "cut.jpg", "corrupt"
    if kind == "scrambled":  # the right length and end marker, bytes inside flipped: only decoding tells
        good.save(tmp_path / "full.png")
        data = bytearray((tmp_path / "full.png").read_bytes())
        data[len(data) // 2: len(data) // 2 + 16] = bytes(b ^ 0xFF for b in data[len(data) // 2: len(data) // 2 + 16])
        (tmp_path / "scrambled.png").write_bytes(bytes(data))
        return "scrambled.png", "corrupt"
    if kind == "extension":
        (tmp_path / "doc.txt").write_text("hello")
        return "doc.txt", "unsupported file type '.txt'"
    if kind == "tiny":
        Image.new("RGB", (8, 40)).save(tmp_path / "tiny.png")
        return "tiny.png", "smaller than the division factor"
    raise AssertionError(kind)


KINDS = ["missing", "empty", "text", "corrupt", "truncated_jpeg", "scrambled", "extension", "tiny"]
FOUND_ONLY_WHEN_LOADED = ("scrambled", "tiny")  # the rest the cheap pre-check finds


@pytest.mark.parametrize("kind", KINDS)
def test_bad_file_errors_name_row_and_file(data, kind):
    name, reason = bad_file(data, kind)
    meta = write_metadata(data / "m.csv", [ROWS[0], ROWS[1], {**ROWS[2], "image": name}])
    ds = UnifiedDataset(data, meta, precheck=False)
    ds[0]
    with pytest.raises(DataError) as err:
        ds[2]
    one_line_error(err, "m.csv row 3", name, reason)
    if kind in FOUND_ONLY_WHEN_LOADED:
        assert UnifiedDataset(data, meta).num_rows == 3
    else:  # found when the data set is built, before any row is loaded
        with pytest.raises(DataError) as err:
            UnifiedDataset(data, meta)
        one_line_error(err, "m.csv row 3", name, reason)


def test_metadata_errors(tmp_path, data):
    cases = {
        "missing column": (write_metadata(data / "nocol.csv", [{"picture": "a.png", "prompt": "x"}]),
                           ["nocol.csv", "no column 'image'", "--data_file_keys", "picture"]),
        "header only": (tmp_path / "header.csv", ["header.csv", "no rows"]),
        "zero-byte csv": (tmp_path / "zero.csv", ["zero.csv", "empty"]),
        "empty json list": (tmp_path / "e.json", ["e.json", "no rows"]),
        "empty jsonl": (tmp_path / "e.jsonl", ["e.jsonl", "no rows"]),
        "bad jsonl line": (tmp_path / "bad.jsonl", ["bad.jsonl", "line 2"]),
        "json object": (tmp_path / "obj.json", ["obj.json", "list of objects"]),
        "unknown extension": (tmp_path / "m.tsv", ["m.tsv", "unknown metadata format '.tsv'"]),
        "no such file": (tmp_path / "absent.csv", ["absent.csv", "not found"]),
    }
    (tmp_path / "header.csv").write_text("image,prompt\n")
    (tmp_path / "zero.csv").write_text("")
    (tmp_path / "e.json").write_text("[]")
    (tmp_path / "e.jsonl").write_text("\n\n")
    (tmp_path / "bad.jsonl").write_text('{"image": "a.png"}\n{"image": \n')
    (tmp_path / "obj.json").write_text('{"image": "a.png"}')
    (tmp_path / "m.tsv").write_text("image\tprompt\n")
    for case, (path, parts) in cases.items():
        with pytest.raises(DataError) as err:
            UnifiedDataset(data, path)
        one_line_error(err, *parts)
    with pytest.raises(DataError, match="^--dataset_metadata_path is required$"):
        UnifiedDataset(data, None)
    with pytest.raises(DataError) as err:  # a folder of metadata and images: its metadata file is meant
        UnifiedDataset(data, data)
    one_line_error(err, str(data), "a folder holding", "name that file")
    missing_value = write_metadata(data / "gap.jsonl", [ROWS[0], {"prompt": "no image here"}])
    with pytest.raises(DataError) as err:
        UnifiedDataset(data, missing_value)[1]
    one_line_error(err, "gap.jsonl row 2", "no value for 'image'")


def test_errors_pickle_and_surface_from_workers(data):
    err = DataError("m.csv row 3 'image': file not found: /x/y.png")
    again = pickle.loads(pickle.dumps(err))
    assert type(again) is DataError and isinstance(again, UserError) and str(again) == str(err)
    plain = pickle.loads(pickle.dumps(UserError("--dataset_repeat must be at least 1, got 0")))
    assert type(plain) is UserError and str(plain) == "--dataset_repeat must be at least 1, got 0"
    name, _ = bad_file(data, "empty")
    meta = write_metadata(data / "m.csv", [ROWS[0], {**ROWS[1], "image": name}])
    loader = DataLoader(UnifiedDataset(data, meta, precheck=False), batch_size=None, num_workers=2)
    message = None
    try:
        list(loader)
    except DataError as err:
        message = str(err)
        # torch's re-raise leaves a reference cycle through this traceback; left to the garbage
        # collector, the loader's workers take 10 s to shut down
        err.__traceback__ = None
    assert message == f"{meta} row 2 'image': file is empty (0 bytes): {data / name}"


def test_dataloader_workers_return_the_same_items(data):
    meta = write_metadata(data / "m.jsonl", ROWS)
    ds = UnifiedDataset(data, meta, repeat=2)
    direct = list(DataLoader(ds, batch_size=None, num_workers=0))
    loaded = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert len(loaded) == 6
    for a, b in zip(direct, loaded):
        assert a.keys() == b.keys() and a["_id"] == b["_id"] and a["prompt"] == b["prompt"]
        assert a["image"].tobytes() == b["image"].tobytes()


# -- skipping -------------------------------------------------------------------------------------------
def test_skip_prevalidates_and_reports(data):
    rows = [ROWS[0]]
    for kind in ("missing", "empty", "text", "corrupt", "extension"):
        rows.append({"image": bad_file(data, kind)[0], "prompt": kind})
    rows.append(ROWS[1])
    meta = write_metadata(data / "m.csv", rows)
    ds = UnifiedDataset(data, meta, repeat=2, on_bad_sample="skip")
    assert ds.num_rows == 2 and len(ds) == 4
    assert [ds[i]["_row"] for i in range(4)] == [0, 6, 0, 6]
    assert [b["row"] for b in ds.bad_samples] == [2, 3, 4, 5, 6]
    for bad in ds.bad_samples:
        assert bad["file"].startswith(str(data)) and bad["file"] in bad["reason"] and "\n" not in bad["reason"]
    json.dumps(ds.bad_samples)  # the trainer writes it as a report
    with pytest.raises(DataError) as err:
        UnifiedDataset(data, write_metadata(data / "allbad.csv", rows[1:3]), on_bad_sample="skip")
    one_line_error(err, "allbad.csv", "none of its 2 rows")


def test_skip_a_file_that_fails_only_when_decoded(data):
    name, _ = bad_file(data, "scrambled")
    meta = write_metadata(data / "m.csv", [ROWS[0], {**ROWS[1], "image": name}, ROWS[2]])
    ds = UnifiedDataset(data, meta, on_bad_sample="skip", repeat=2)
    assert ds.num_rows == 3 and ds.bad_samples == []  # the header is fine
    with pytest.warns(UserWarning, match="skipping bad sample"):
        assert ds[1] is None  # the trainer and stage 1 leave a None out
    assert len(ds.bad_samples) == 1
    bad = ds.bad_samples[0]
    assert bad["row"] == 2 and bad["id"] == ds.sample_id(1) and bad["key"] == "image"
    assert bad["file"] == str(data / name) and "m.csv row 2" in bad["reason"] and "\n" not in bad["reason"]
    assert ds[4] is None and len(ds.bad_samples) == 1  # recorded once, however often it is asked for
    assert ds[0]["_row"] == 0 and ds[2]["_row"] == 2
    # a worker's None reaches the main process (its bad_samples do not)
    loaded = list(DataLoader(ds, batch_size=None, num_workers=2))
    assert [item if item is None else item["_row"] for item in loaded] == [0, None, 2, 0, None, 2]
    every = write_metadata(data / "every.csv", [{**ROWS[0], "image": name}, {**ROWS[1], "image": name}])
    ds = UnifiedDataset(data, every, on_bad_sample="skip")
    with pytest.warns(UserWarning):
        assert ds[0] is None
        with pytest.raises(DataError) as err:  # no silent training on nothing
            ds[1]
    one_line_error(err, "every.csv", "none of its 2 usable rows could be loaded", name)


def test_skip_keeps_what_error_mode_loads(data):
    """A PNG missing only its end chunk fails PIL's verify() but decodes: both modes keep it."""
    noise_image((64, 64), 40, seed=1).save(data / "full.png")
    (data / "noend.png").write_bytes((data / "full.png").read_bytes()[:-12])
    meta = write_metadata(data / "m.csv", [ROWS[0], {**ROWS[1], "image": "noend.png"}])
    strict = UnifiedDataset(data, meta)[1]["image"]
    lenient = UnifiedDataset(data, meta, on_bad_sample="skip")
    assert lenient.num_rows == 2 and lenient.bad_samples == []
    assert lenient[1]["image"].tobytes() == strict.tobytes()


def test_csv_with_a_duplicated_column_is_refused_naming_it(tmp_path):
    path = tmp_path / "meta.csv"
    path.write_text("image,prompt,prompt,video\na.png,a cat,a dog,v.mp4\n")
    with pytest.raises(DataError) as err:
        read_metadata(path)
    assert str(err.value) == f"{path}: the column 'prompt' appears 2 times; name each column once"
    path.write_text("image,prompt\na.png,a cat\n")
    assert read_metadata(path) == [{"image": "a.png", "prompt": "a cat"}]


@pytest.mark.parametrize("extra_row", [1, 2])
def test_a_csv_row_with_an_extra_field_is_named(tmp_path, extra_row):
    """A first row with an extra field shifted every value one column left (pandas read the first column as an index)
    and was blamed on the next row's empty prompt; a later one was 'line 3' of the file."""
    rows = ["a.png,a dog", "b.png,a cat", "c.png,a bird"]
    rows[extra_row - 1] += ",extra"
    (tmp_path / "m.csv").write_text("\n".join(["image,prompt", *rows]) + "\n")
    with pytest.raises(DataError, match=rf"^{tmp_path / 'm.csv'} row {extra_row}: 3 fields, the header names 2 "
                                        rf"columns \(image, prompt\); quote a value with a comma in it"):
        read_metadata(tmp_path / "m.csv")
    (tmp_path / "m.csv").write_text('image,prompt\n\na.png,"a dog, running"\n')
    assert read_metadata(tmp_path / "m.csv") == [{"image": "a.png", "prompt": "a dog, running"}]


def test_empty_prompts_train_as_the_empty_string(tmp_path):
    meta = write_example_dataset(tmp_path, n=2, size=(48, 32))
    meta.write_text("image,prompt\nimage_1.png,a red circle\nimage_2.png,\n")
    data = UnifiedDataset(tmp_path, meta, allow_empty_prompts=True)
    assert [data[i]["prompt"] for i in range(2)] == ["a red circle", ""]  # not None, not "NaN"


def test_max_pixels_too_small_names_the_flag(tmp_path):
    op = ImageCropAndResize(max_pixels=100, height_division_factor=16, width_division_factor=16)
    with pytest.raises(DataError) as err:
        op(Image.new("RGB", (64, 48)), {"where": "m.csv row 1", "file": "a.png"})
    assert "--max_pixels 100" in str(err.value) and "at least 342" in str(err.value)
    assert "smaller than" not in str(err.value)
    fixed = ImageCropAndResize(max_pixels=342, height_division_factor=16, width_division_factor=16)
    assert fixed(Image.new("RGB", (64, 48))).size == (16, 16)  # the least it names is enough
    with pytest.raises(DataError, match="image is 8x8, smaller than the division factor"):  # a tiny image is the image's fault
        op(Image.new("RGB", (8, 8)), {"where": "m.csv row 1", "file": "a.png"})


def test_metadata_paths_outside_the_data_set_are_refused_unless_allowed(tmp_path):
    data, other = tmp_path / "data", tmp_path / "other"
    data.mkdir(), other.mkdir()
    Image.new("RGB", (16, 16), "red").save(data / "in.png")
    Image.new("RGB", (16, 16), "blue").save(other / "out.png")
    os.symlink(other / "out.png", data / "link.png")
    for value in ("../other/out.png", str(other / "out.png"), "link.png"):
        meta = data / "meta.csv"
        meta.write_text(f"image,prompt\nin.png,a\n{value},b\n")
        with pytest.raises(DataError) as err:
            UnifiedDataset(data, meta, progress=False)
        assert str(err.value) == (f"{meta} row 2 'image': {value} resolves to {other / 'out.png'}, outside the data "
                                  f"set folder {data}; pass --allow_paths_outside_dataset to read files there")
        ds = UnifiedDataset(data, meta, progress=False, allow_paths_outside=True)
        assert len(ds) == 2 and ds[1]["image"].getpixel((0, 0)) == (0, 0, 255)


def test_allow_paths_outside_dataset_is_a_train_flag():
    from difftune.cli.args import training_parser

    # the parser `difftune train` reads its flags with (in this process: no interpreter start, ~8 s of imports)
    parser = training_parser()
    assert "--allow_paths_outside_dataset" in parser.format_help()
    args = parser.parse_args(["--dataset_base_path", "d", "--allow_paths_outside_dataset"])
    assert args.allow_paths_outside_dataset


# -- pictures whose header declares a huge canvas (a few bytes, billions of pixels) ---------------------------------

def _huge_canvas(path, width=30000, height=30000):
    """A GIF (logical screen), a PNG (IHDR) or an animated WebP (VP8X canvas) of 2 x 2 real pixels whose header
    declares width x height: what PIL calls a decompression bomb."""
    import io
    import struct
    import zlib

    fmt = path.suffix.lower()
    buf = io.BytesIO()
    frames = [Image.new("RGB", (2, 2), c) for c in ("red", "blue")]
    if fmt == ".gif":
        frames[0].save(buf, "GIF", save_all=True, append_images=frames[1:])
        data = bytearray(buf.getvalue())
        data[6:10] = struct.pack("<HH", width, height)
    elif fmt == ".png":
        frames[0].save(buf, "PNG")
        data = bytearray(buf.getvalue())
        data[16:24] = struct.pack(">II", width, height)
        data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    else:
        frames[0].save(buf, "WEBP", save_all=True, append_images=frames[1:])
        data = bytearray(buf.getvalue())
        at = data.index(b"VP8X") + 12
        data[at:at + 6] = (width - 1).to_bytes(3, "little") + (height - 1).to_bytes(3, "little")
    path.write_bytes(bytes(data))
    return path


@pytest.mark.parametrize("column", ["image", "video"])
@pytest.mark.parametrize("name", ["huge.gif", "huge.png", "huge.webp"])
def test_a_picture_with_a_huge_declared_canvas_is_one_line_naming_the_row_and_file(tmp_path, column, name):
    """In an image column and in a clip column (a GIF or WebP is an animation there, a PNG a one-frame clip): PIL's
    DecompressionBombError traceback before, for the clip column; now the data error naming row and file."""
    picture = _huge_canvas(tmp_path / name)
    meta = write_metadata(tmp_path / "m.csv", [{column: name, "prompt": "x"}])
    operator = (UnifiedDataset.default_video_operator(tmp_path, max_pixels=4096, num_frames=1) if column == "video"
                else UnifiedDataset.default_image_operator(tmp_path, max_pixels=4096))
    with pytest.raises(DataError) as err:
        ds = UnifiedDataset(tmp_path, meta, data_file_keys=(column,), main_data_operator=operator)
        ds.precheck(progress=False)
        ds[0]
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{meta} row 1 '{column}': "), msg
    assert msg.endswith(f"image too large: its header declares 900000000 pixels, over the decoder's limit of "
                        f"{Image.MAX_IMAGE_PIXELS * 2} (a decompression bomb?): {picture}"), msg
