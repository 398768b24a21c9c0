"""The unified dataset: a metadata file (csv, json or jsonl) whose file fields are relative to a base path.

An item is the row's columns (strings and numbers; None where a row has no value), with the fields
named in `data_file_keys` (and file-valued `extra_inputs`) loaded by the operators, plus `_row` (the
0-based row index) and `_id` (a stable sample id for the stage-1 cache: zero-padded row index and a
short hash of the row). Messages and `bad_samples` number rows from 1, the first data row being row 1.

Every row is pre-checked cheaply when the dataset is built (files exist, are not empty, their image
header and mode read, and they are not cut short: `precheck`), so a bad row stops a run before its
first step, not hours in. `on_bad_sample="error"` raises the first bad row's one-line error there;
`"skip"` leaves the bad rows out and lists them in `bad_samples`, so every process and DataLoader worker
sees the same rows. A file that passes that check but fails to decode is found only when loaded: in skip
mode the item is then None (the trainer and stage 1 both leave it out, so split and one-stage training
skip the same rows; a DataLoader worker's `bad_samples` never reach the main process, a None does) and
the row is added to that process's `bad_samples` with a warning.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import warnings
from typing import Any

import torch

from PIL import Image

from ..media.audio import AUDIO_EXTENSIONS
from ..media.image import too_large
from ..media.video import VIDEO_EXTENSIONS
from ..util import names
from .operators import (IMAGE_EXTENSIONS, UNKNOWN, DataError, DataOperator, Frames, ImageCropAndResize, LoadImage,
                        RouteByExtension, RouteByListing, Seconds, ToAbsolutePath, compose, one_line)

# what makes an --extra_inputs column a file column (loaded by its operator, and in the cache's fingerprint)
FILE_EXTENSIONS = IMAGE_EXTENSIONS + VIDEO_EXTENSIONS + AUDIO_EXTENSIONS
PROMPT_KEY = "prompt"
# Always text, whatever they look like: a prompt "1984" or "False" is words, not a number or a flag.
TEXT_COLUMNS = (PROMPT_KEY, "negative_prompt")
PROGRESS_ROWS = 1000  # the pre-check shows a progress bar from this many rows on
_INT = re.compile(r"[+-]?\d+")
_FLOAT = re.compile(r"[+-]?(\d+\.\d*|\.\d+|\d+)([eE][+-]?\d+)?")


def _convert_csv_column(values: list[str], keep_text: bool) -> list:
    """A csv column as the user means it: empty cells are None; a column whose every value is an
    integer (a seed, a step count) becomes int, else float, else bool; anything else stays text."""
    present = [v for v in values if v != ""]
    convert = str
    if present and not keep_text:
        if all(_INT.fullmatch(v) for v in present):
            convert = int
        elif all(_FLOAT.fullmatch(v) for v in present):
            convert = float
        elif all(v.lower() in ("true", "false") for v in present):
            convert = lambda v: v.lower() == "true"  # noqa: E731
    return [None if v == "" else convert(v) for v in values]


def _check_csv_layout(path: str) -> None:
    """What pandas would take quietly: a repeated header is renamed ('prompt', 'prompt.1'), so one of the two would
    be dropped unseen; a first row with one field more than the header makes pandas read the first column as an
    index, shifting every row's values one column left (a later row's is a parse error naming a file line)."""
    import csv
    from collections import Counter

    with open(path, encoding="utf-8-sig", newline="") as f:
        reader = csv.reader(f, skipinitialspace=True)
        header = next(reader, [])
        for name, count in Counter(c.strip() for c in header).items():
            if count > 1:
                raise DataError(f"{path}: the column '{name}' appears {count} times; name each column once")
        try:
            rows = (r for r in reader if r)  # pandas skips blank lines
            for n, fields in enumerate(rows, 1):
                if len(fields) > len(header):
                    raise DataError(f"{path} row {n}: {len(fields)} fields, the header names {len(header)} columns "
                                    f"({', '.join(c.strip() for c in header)}); quote a value with a comma in it "
                                    f"(\"a, b\")")
        except csv.Error:
            pass  # pandas names the broken line


def _read_csv(path: str, text_columns) -> list[dict[str, Any]]:
    import pandas as pd

    _check_csv_layout(path)
    try:
        # everything as text first (no NaN, no "None" -> NaN), then convert per column
        frame = pd.read_csv(path, dtype=str, keep_default_na=False, skipinitialspace=True, encoding="utf-8-sig")
    except pd.errors.EmptyDataError:
        raise DataError(f"{path}: the metadata file is empty") from None
    except pd.errors.ParserError as err:
        raise DataError(f"{path}: not valid CSV ({one_line(err)})") from None
    frame.columns = [str(c).strip() for c in frame.columns]
    columns = {c: _convert_csv_column([str(v) for v in frame[c].tolist()], c in text_columns) for c in frame.columns}
    return [{c: columns[c][i] for c in frame.columns} for i in range(len(frame))]


def _as_text(value):
    """A JSON number or true/false in a text column, as the text the user typed (1984 -> "1984"); NaN and infinity
    are no text anyone typed as a prompt, and stay numbers (the prompt check refuses them)."""
    if isinstance(value, float) and not math.isfinite(value):
        return value
    if isinstance(value, (bool, int, float)):
        return json.dumps(value)
    return value


def read_metadata(path, text_columns=()) -> list[dict[str, Any]]:
    """Rows of a .csv, .json (a list of objects) or .jsonl metadata file, or of a folder of images with their
    caption files (kohya's layout, `read_caption_folder`). `text_columns` (and the prompt
    columns, TEXT_COLUMNS) stay strings; in a csv file, other columns whose every value is a number or
    true/false become numbers or booleans (see `_convert_csv_column`)."""
    text_columns = set(text_columns) | set(TEXT_COLUMNS)
    path = os.fspath(path)
    if not os.path.exists(path):
        raise DataError(f"--dataset_metadata_path {path}: file not found")
    if os.path.isdir(path):
        return read_caption_folder(path)
    ext = os.path.splitext(path)[1].lower()
    if ext not in (".csv", ".json", ".jsonl"):
        raise DataError(f"--dataset_metadata_path {path}: unknown metadata format '{ext or '(no extension)'}' "
                        f"(use .csv, .json or .jsonl)")
    try:
        if ext == ".csv":
            rows = _read_csv(path, text_columns)
        elif ext == ".json":
            with open(path, encoding="utf-8-sig") as f:
                text = f.read()
            if not text.strip():
                raise DataError(f"{path}: the metadata file is empty")
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as err:
                raise DataError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
            if not isinstance(rows, list):
                raise DataError(f"{path}: a .json metadata file must hold a list of objects")
        else:
            rows = []
            with open(path, encoding="utf-8-sig") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            rows.append(json.loads(line))
                        except json.JSONDecodeError as err:
                            raise DataError(f"{path}: line {n} is not valid JSON ({err.msg})") from None
    except UnicodeDecodeError:
        raise DataError(f"{path}: the metadata file is not UTF-8 text") from None
    for n, row in enumerate(rows, 1):
        if not isinstance(row, dict):
            raise DataError(f"{path} row {n}: a row must be an object with named fields, got {type(row).__name__}")
    if not rows:
        raise DataError(f"{path}: the metadata file has no rows")
    if ext != ".csv":
        for row in rows:
            for key in text_columns & row.keys():
                row[key] = _as_text(row[key])
    return rows


CAPTION_EXTENSIONS = (".txt", ".caption")  # kohya's: a caption file of the image's name beside it
_REPEATS_FOLDER = re.compile(r"^(\d+)_(.*)$")  # kohya's `<repeats>_<class tokens>/` subfolders
METADATA_EXTENSIONS = (".csv", ".json", ".jsonl")


def caption_files(folder) -> list[str]:
    """The caption files a caption folder's rows read (what its cache's identity follows)."""
    return sorted(os.path.join(d, f) for d, _, files in os.walk(folder) for f in files
                  if os.path.splitext(f)[1].lower() in CAPTION_EXTENSIONS)


def read_caption_folder(folder) -> list[dict[str, Any]]:
    """kohya's data layout as rows (`image`: its absolute path, `prompt`): the images in `folder` and in its
    subfolders one level down, each with the caption file of its name beside it (.txt, else .caption). A subfolder
    named `<repeats>_<class tokens>` gives each of its images `repeats` times, and its class tokens to an image
    without a caption file; any other image without one is refused, naming the file it looked for."""
    folder = os.path.abspath(os.fspath(folder))
    present = sorted(n for n in os.listdir(folder) if os.path.splitext(n)[1].lower() in METADATA_EXTENSIONS
                     and os.path.isfile(os.path.join(folder, n)))
    if present:
        raise DataError(f"--dataset_metadata_path {folder}: a folder holding {present[0]}: name that file, or "
                        f"remove it to read the folder's images and their caption files")
    places = [(folder, 1, None)]
    for name in sorted(os.listdir(folder)):
        sub = os.path.join(folder, name)
        if os.path.isdir(sub) and not name.startswith("."):
            m = _REPEATS_FOLDER.match(name)
            places.append((sub, int(m.group(1)), m.group(2).replace("_", " ").strip()) if m else (sub, 1, None))
    rows = []
    for where, repeats, tokens in places:
        if repeats < 1:
            raise DataError(f"{where}: a folder of 0 repeats (kohya's <repeats>_<name>) trains nothing")
        for name in sorted(os.listdir(where)):
            image = os.path.join(where, name)
            stem, ext = os.path.splitext(image)
            if name.startswith(".") or ext.lower() not in IMAGE_EXTENSIONS or not os.path.isfile(image):
                continue
            caption = next((stem + c for c in CAPTION_EXTENSIONS if os.path.isfile(stem + c)), None)
            if caption is not None:
                try:
                    with open(caption, encoding="utf-8-sig") as f:
                        prompt = f.read().strip()
                except UnicodeDecodeError:
                    raise DataError(f"{caption}: the caption file is not UTF-8 text") from None
            elif tokens:
                prompt = tokens
            else:
                raise DataError(f"{image}: no caption file beside it ({os.path.basename(stem)}.txt or .caption)")
            rows.extend({"image": image, "prompt": prompt} for _ in range(repeats))
    if not rows:
        raise DataError(f"--dataset_metadata_path {folder}: no images ({', '.join(IMAGE_EXTENSIONS)}) in the folder "
                        f"or its subfolders")
    return rows


def _looks_like_files(rows: list[dict], key: str) -> bool:
    values = [r.get(key) for r in rows if r.get(key) not in (None, "")]
    flat = [v for value in values for v in (value if isinstance(value, list) else [value])]
    return bool(flat) and all(isinstance(v, str) and os.path.splitext(v.strip())[1].lower() in FILE_EXTENSIONS
                              for v in flat)


def _entries(value) -> int:
    """How many items a list-valued cell gives: a list, a JSON list written in a CSV cell, or one value."""
    if isinstance(value, str) and value.lstrip().startswith("["):
        try:
            value = json.loads(value)
        except ValueError:
            pass  # not a list: one value (the column's own check names what is wrong with it)
    return len(value) if isinstance(value, list) else 0 if value in (None, "") else 1


class _bombs_refused:
    """A picture read by an operator other than the image decoder's (an animation in a clip column) whose header
    declares a huge canvas: PIL's DecompressionBombError becomes the row's data error naming the file."""

    def __init__(self, context: dict):
        self.context = context

    def __enter__(self):
        return self

    def __exit__(self, kind, err, tb):
        if kind is not None and issubclass(kind, Image.DecompressionBombError):
            where = f"{self.context['where']} '{self.context['key']}'"
            raise DataError(f"{where}: {too_large(err)}: {self.context.get('file', '')}") from None
        return False


def _is_clip(value) -> bool:
    from PIL import Image

    return isinstance(value, list) and bool(value) and all(isinstance(v, Image.Image) for v in value)


class UnifiedDataset(torch.utils.data.Dataset):
    def __init__(self, base_path, metadata_path, repeat: int = 1, data_file_keys=("image",),
                 main_data_operator=None, special_operator_map: dict | None = None, extra_inputs=(),
                 on_bad_sample: str = "error", present_keys_only: bool = False, allow_empty_prompts: bool = False,
                 precheck: bool = True, progress: bool = True, frame_inputs: dict | None = None,
                 paired_columns=(), required_columns=(), allow_paths_outside: bool = False,
                 aligned_columns: dict | None = None, clip_columns=(), file_inputs=(), hidden_columns=()):
        """`base_path` None means the metadata file's folder. `present_keys_only` drops listed file keys
        the metadata lacks (for the CLI default "image,video"), as long as one is left. Metadata without a
        `prompt` column is refused unless `allow_empty_prompts` (every sample would train on "").
        `precheck`: check every row's files now (see `precheck`); `progress`: its progress bar (shown from
        PROGRESS_ROWS rows on). `frame_inputs` ({name: (clip column, frame index)}, e.g. {"input_image":
        ("video", 0), "end_image": ("video", -1)}): an `extra_inputs` name listed there that the metadata has
        no column for is that frame of the row's clip (as the reference's Wan script takes them); where the
        metadata has the column, its file is loaded, a one-frame clip as the frame itself. `paired_columns`: pairs
        of columns whose lists must have as many entries (a pipeline's `paired_columns`), checked per row with the
        files. `file_inputs`: columns whose values are files (the features' images and clips): one that
        `extra_inputs` names and `data_file_keys` does not is loaded only when every value is a file name, else the
        first row that is not is refused. `hidden_columns`: columns loaded (and checked) as they are named, but left
        out of the items handed on (a feature's column that --extra_inputs does not name: the reference's train.py
        hands its pipeline --extra_inputs alone). `required_columns`: columns every row must give a value in (the run trains a feature on them: an
        empty cell would switch it off for that row without a word). A file that resolves (`..`, an absolute path, a
        link) outside the base path is refused unless `allow_paths_outside` (--allow_paths_outside_dataset).
        `aligned_columns` ({column: None for a clip, or the frame rate its audio is timed at}): inputs timed frame by
        frame with the row's clip (the first of `clip_columns` the row has), which must cover it: a clip file with
        at least the clip's frames, audio at least as long as the clip's frames after the first at that rate."""
        if metadata_path is None:
            raise DataError("--dataset_metadata_path is required")
        if on_bad_sample not in ("error", "skip"):
            raise DataError(f"--on_bad_sample must be 'error' or 'skip', got {on_bad_sample!r}")
        if int(repeat) < 1:
            raise DataError(f"--dataset_repeat must be at least 1, got {repeat}")
        self.metadata_path = os.fspath(metadata_path)
        self.base_path = (os.fspath(base_path) if base_path is not None else self.metadata_path
                          if os.path.isdir(self.metadata_path) else os.path.dirname(self.metadata_path))
        self.repeat = int(repeat)
        self.on_bad_sample = on_bad_sample
        self.allow_paths_outside = bool(allow_paths_outside)
        keys, extra = names(data_file_keys), names(extra_inputs)
        self.rows = read_metadata(self.metadata_path, text_columns=keys)  # file names stay text
        self.columns = list(dict.fromkeys(c for r in self.rows for c in r))
        if present_keys_only:
            keys = [k for k in keys if k in self.columns] or keys
        self.frame_inputs = dict(frame_inputs or {})
        self.paired_columns = [tuple(p) for p in paired_columns if all(c in self.columns for c in p)]
        self.required_columns = [c for c in required_columns if c in self.columns]
        self.aligned_columns = {c: r for c, r in (aligned_columns or {}).items() if c in self.columns}
        self.clip_columns = tuple(clip_columns)
        # extra inputs taken from a clip's frames: name -> (column, frame index)
        self.derived = {k: tuple(self.frame_inputs[k]) for k in extra
                        if k in self.frame_inputs and k not in self.columns}
        for name, (column, _) in self.derived.items():
            if column not in keys:
                raise DataError(f"--extra_inputs {name}: it is a frame of the '{column}' clip, but '{column}' is "
                                f"not loaded (name it in --data_file_keys, or give the metadata a '{name}' column)")
        named = [k for k in extra if k not in self.derived]
        for flag, listed in (("--data_file_keys", keys), ("--extra_inputs", named)):
            for key in listed:
                if key not in self.columns:
                    raise DataError(f"{self.metadata_path}: no column '{key}' (named by {flag}); "
                                    f"its columns are {', '.join(self.columns)}")
        if PROMPT_KEY not in self.columns and not allow_empty_prompts:
            raise DataError(f"{self.metadata_path}: no '{PROMPT_KEY}' column (its columns are "
                            f"{', '.join(self.columns)}), so every sample would train on an empty prompt; name the "
                            f"caption column '{PROMPT_KEY}', or pass --allow_empty_prompts if empty prompts are meant")
        if PROMPT_KEY in self.columns:
            self._check_prompts(allow_empty_prompts)
        self.data_file_keys = keys + [k for k in extra if k not in keys and k not in self.derived
                                      and _looks_like_files(self.rows, k)]
        for key in file_inputs:  # a file column handed on as text would be refused at its first batch, row unknown
            if key in extra and key in self.columns and key not in self.data_file_keys:
                self._refuse_unloaded_files(key, keys)
        self.extra_inputs = extra
        self.hidden_columns = frozenset(hidden_columns) - set(extra)
        self.main_data_operator = (compose(main_data_operator) if main_data_operator is not None
                                   else self.default_image_operator(self.base_path))
        self.special_operator_map = {k: compose(v) for k, v in (special_operator_map or {}).items()}
        width = max(6, len(str(len(self.rows) - 1)))
        self._ids = [f"{i:0{width}d}-{self._row_hash(r)}" for i, r in enumerate(self.rows)]
        self.bad_samples: list[dict[str, Any]] = []
        self._good = list(range(len(self.rows)))
        self._failed: set[int] = set()  # rows that passed pre-validation but failed to load here
        if precheck:
            self.precheck(progress)

    def _check_prompts(self, allow_empty: bool) -> None:
        """Every row's prompt is text with words in it. An empty cell, a row without the field or a value that is
        not text (NaN, a number JSON gives as NaN, a list) is refused naming the row, as a missing column is, unless
        `allow_empty`: that row then trains on the empty prompt."""
        for n, row in enumerate(self.rows, 1):
            value = row.get(PROMPT_KEY)
            if isinstance(value, str) and value.strip():
                continue
            if not allow_empty:
                what = ("is empty" if value is None or isinstance(value, str) else
                        f"is not text ({value!r})" if isinstance(value, float) else
                        f"is not text (a {type(value).__name__})")
                raise DataError(f"{self.metadata_path} row {n}: its '{PROMPT_KEY}' {what}; write the caption, or pass "
                                f"--allow_empty_prompts if rows without one are meant to train on an empty prompt")
            row[PROMPT_KEY] = ""

    @staticmethod
    def default_image_operator(base_path, height: int | None = None, width: int | None = None,
                               max_pixels: int = 1024 * 1024, height_division_factor: int = 16,
                               width_division_factor: int = 16, mode: str = "RGB") -> DataOperator:
        """Path -> 8-bit `mode` (RGB, or RGBA to keep alpha) image, cropped and resized (fixed size, or dynamic
        under max_pixels)."""
        return (ToAbsolutePath(base_path) >> RouteByExtension({IMAGE_EXTENSIONS: LoadImage(mode)})
                >> ImageCropAndResize(height, width, max_pixels, height_division_factor, width_division_factor))

    @staticmethod
    def default_video_operator(base_path, height: int | None = None, width: int | None = None,
                               max_pixels: int = 1024 * 1024, height_division_factor: int = 16,
                               width_division_factor: int = 16, num_frames: int | None = None,
                               time_division_factor: int = 1, time_division_remainder: int = 0) -> DataOperator:
        """Path -> list of RGB frames (a clip's leading `num_frames`, or the largest
        `time_division_factor * k + time_division_remainder` a shorter one has; a still image is a one-frame clip),
        each cropped and resized as `default_image_operator` would."""
        from .video import video_operator

        return video_operator(base_path, height, width, max_pixels, height_division_factor, width_division_factor,
                              num_frames, time_division_factor, time_division_remainder)

    @staticmethod
    def _row_hash(row: dict) -> str:
        text = json.dumps(row, sort_keys=True, default=str, ensure_ascii=False)
        return hashlib.sha256(text.encode("utf-8")).hexdigest()[:8]

    # -- indexing -------------------------------------------------------------------------------------
    @property
    def num_rows(self) -> int:
        """Rows the dataset serves (bad rows left out when skipping)."""
        return len(self._good)

    def __len__(self) -> int:
        return self.num_rows * self.repeat

    def row_index(self, index: int) -> int:
        return self._good[index % self.num_rows]

    def sample_id(self, index: int) -> str:
        return self._ids[self.row_index(index)]

    # -- loading --------------------------------------------------------------------------------------
    def _refuse_unloaded_files(self, key: str, keys: list[str]) -> None:
        """`key` names files (a feature's images or clip) and --data_file_keys does not name it: it is loaded only
        when every value is a file name. The first row whose value is not one is named."""
        for n, row in enumerate(self.rows, 1):
            value = row.get(key)
            if value in (None, ""):
                continue
            if not _looks_like_files([row], key):
                raise DataError(f"{self.metadata_path} row {n}: '{key}' is {value!r:.60}, not a file name; '{key}' is "
                                f"a file column that --extra_inputs names and --data_file_keys does not, so it is "
                                f"loaded only when every value is one: fix the row, or name it in --data_file_keys "
                                f"(--data_file_keys {','.join([*keys, key])})")

    def _context(self, row: int, key: str) -> dict[str, Any]:
        return {"where": f"{self.metadata_path} row {row + 1}", "key": key, "row": row,
                "many": isinstance(self.rows[row].get(key), list)}

    def _values(self, row: int, key: str) -> list:
        """The file value(s) of one field; a list value (json) is several files."""
        value = self.rows[row].get(key)
        if value is None or value == "" or value == []:
            raise DataError(f"{self.metadata_path} row {row + 1}: no value for '{key}'")
        return value if isinstance(value, list) else [value]

    def _operator(self, key: str) -> DataOperator:
        return self.special_operator_map.get(key, self.main_data_operator)

    def load_row(self, row: int) -> dict[str, Any]:
        """Row `row` (0-based) loaded; raises DataError naming the row and the file."""
        source = self.rows[row]
        item = {c: source.get(c) for c in self.columns}
        for key in self.data_file_keys:
            op, value, context = self._operator(key), source.get(key), self._context(row, key)
            try:
                with _bombs_refused(context):
                    loaded = [op(v, context) for v in self._values(row, key)]
            except DataError as err:
                err.key, err.file = key, context.get("file")  # for bad_samples
                raise
            item[key] = loaded if isinstance(value, list) else loaded[0]
            if key in self.frame_inputs:
                item[key] = self._one_frame(item[key], row, key, context.get("file"))
        for name, (column, index) in self.derived.items():
            clip = item[column]
            if not _is_clip(clip):
                what = "several files" if isinstance(clip, list) else type(clip).__name__
                raise DataError(f"{self.metadata_path} row {row + 1}: --extra_inputs {name} is a frame of "
                                f"'{column}', which is not one clip here (got {what})")
            item[name] = clip[index]
        for key in self.hidden_columns:
            item.pop(key, None)
        item["_row"] = row
        item["_id"] = self._ids[row]
        return item

    def _one_frame(self, value, row: int, key: str, file):
        """A frame input given as its own column: a still (a one-frame clip) is the frame itself."""
        if _is_clip(value):
            if len(value) != 1:
                raise DataError(f"{self.metadata_path} row {row + 1} '{key}': expected one image, got a clip of "
                                f"{len(value)} frames: {file}")
            return value[0]
        return value

    def _record(self, row: int, key: str | None, file: str | None, reason: str) -> None:
        self.bad_samples.append({"row": row + 1, "id": self._ids[row], "key": key, "file": file, "reason": reason})

    def precheck(self, progress: bool = True) -> None:
        """Check every row's files cheaply (exist, not empty, header, image mode, not cut short) before the
        first step, so a bad row near the end stops a run in seconds instead of hours in. Error mode: raise
        the first bad row's one-line error (and how many more rows are bad); skip mode: leave the bad rows
        out and list them in `bad_samples`, so every process and worker sees the same rows."""
        from tqdm.auto import tqdm

        rows = tqdm(self._good, desc=f"checking {os.path.basename(self.metadata_path)}", unit="row", leave=False,
                    disable=not progress or len(self._good) < PROGRESS_ROWS or os.environ.get("RANK", "0") != "0")
        found = len(self.bad_samples)
        self._good = [i for i in rows if self._prevalidate(i)]
        bad = self.bad_samples[found:]
        if bad and self.on_bad_sample == "error":
            more = f" (and {len(bad) - 1} more bad row{'s' if len(bad) > 2 else ''})" if len(bad) > 1 else ""
            del self.bad_samples[found:]  # nothing is skipped in error mode
            raise DataError(bad[0]["reason"] + more)
        if not self._good:
            raise DataError(f"{self.metadata_path}: none of its {len(self.rows)} rows is usable "
                            f"(first problem: {self.bad_samples[0]['reason']})")

    def row_shape(self, row: int) -> tuple:
        """The sizes row `row` (0-based) will have once loaded, per file column, from the headers where the
        operators can tell (else by loading the row, for the columns they cannot tell)."""
        parts, unknown = [], False
        for key in self.data_file_keys:
            op, context = self._operator(key), self._context(row, key)
            try:
                with _bombs_refused(context):
                    sizes = tuple(op.shape(v, context) for v in self._values(row, key))
            except DataError:
                return ("unreadable", row)  # found bad when loaded (skipped, or the error stops the run)
            if any(s is UNKNOWN for s in sizes):
                unknown = True
            elif key in self.frame_inputs:  # loaded as the frame itself (see `_one_frame`)
                sizes = tuple(s[:2] if isinstance(s, tuple) and s[2:] == (1,) else s for s in sizes)
            parts.append((key, sizes))
        return self._loaded_shape(row, dict(parts)) if unknown else tuple(parts)

    def _loaded_shape(self, row: int, known: dict | None = None) -> tuple:
        """As `row_shape`, loading the row for the columns whose operators cannot tell (`known`: the others'
        sizes, kept as the operators give them, so that rows agree however they were measured)."""
        try:
            item = self.load_row(row)
        except DataError:
            return ("unreadable", row)

        def size(v):
            if _is_clip(v):  # (width, height, frames), as the headers give it
                return (*v[0].size, len(v))
            if hasattr(v, "shape"):  # an array or tensor (e.g. a waveform)
                return tuple(v.shape)
            return tuple(v.size) if hasattr(v, "size") and not callable(v.size) else repr(type(v))

        known = {k: v for k, v in (known or {}).items() if all(s is not UNKNOWN for s in v)}
        # a list value in the metadata is several files; a clip alone is one value
        return tuple((key, known[key] if key in known else
                      tuple(size(v) for v in (item[key] if isinstance(self.rows[row].get(key), list) else [item[key]])))
                     for key in self.data_file_keys)

    def bucket_keys(self, columns=()) -> list:
        """Per sample index: its shapes and the values of `columns` (what must agree for samples to share a
        batch). Read from the files' headers once per row."""
        per_row: dict[int, tuple] = {}
        keys = []
        for i in range(len(self)):
            row = self.row_index(i)
            if row not in per_row:
                per_row[row] = (self.row_shape(row), tuple(self.rows[row].get(c) for c in columns))
            keys.append(per_row[row])
        return keys

    def source_files(self, row: int) -> list[str]:
        """The files row `row` (0-based) is loaded from, as its operators resolve them (no file access).
        Values whose operator does not start by resolving a path (a custom operator) are left out."""
        return list(dict.fromkeys(path for _, _, path in self._resolved(row)))

    def _outside(self, row: int) -> str | None:
        """The problem line of row `row`'s first file that resolves outside the base path (links followed)."""
        home = os.path.realpath(self.base_path or ".")
        for key, value, path in self._resolved(row):
            real = os.path.realpath(path)
            if os.path.commonpath([home, real]) != home:
                return (f"{self.metadata_path} row {row + 1} '{key}': {value} resolves to {real}, outside the data "
                        f"set folder {home}; pass --allow_paths_outside_dataset to read files there")
        return None

    def _resolved(self, row: int) -> list[tuple[str, str, str]]:
        """(column, value, path) of each file of row `row` its operators resolve (no file access)."""
        files = []
        for key in self.data_file_keys:
            op = self._operator(key)
            if isinstance(op, RouteByListing):  # the operator this row's value goes through
                op = op.route(self._context(row, key))
            step = op if isinstance(op, ToAbsolutePath) else next(
                (o for o in getattr(op, "operators", ()) if isinstance(o, ToAbsolutePath)), None)
            value = self.rows[row].get(key)
            for v in (value if isinstance(value, list) else [value]):
                try:
                    if step is not None and v not in (None, ""):
                        files.append((key, v, step(v)))
                except DataError:
                    pass  # not a file name: the pre-check reports it
        return files

    def _prevalidate(self, row: int) -> bool:
        outside = None if self.allow_paths_outside else self._outside(row)
        if outside:
            self._record(row, None, None, outside)
            return False
        for column in self.required_columns:
            value = self.rows[row].get(column)
            if value is None or (isinstance(value, str) and not value.strip()) or \
                    (isinstance(value, float) and value != value):
                self._record(row, column, None, f"{self.metadata_path} row {row + 1}: '{column}' is empty, but the "
                                                f"run trains on it (--extra_inputs {column}): give every row a value")
                return False
        for a, b in self.paired_columns:
            va, vb = self.rows[row].get(a), self.rows[row].get(b)
            if va is None and vb is None:
                continue
            na, nb = (_entries(v) for v in (va, vb))
            if na != nb:
                self._record(row, b, None, f"{self.metadata_path} row {row + 1}: '{a}' has {na} entr"
                                           f"{'y' if na == 1 else 'ies'} and '{b}' {nb}; they go in pairs (one of "
                                           f"each per item)")
                return False
        for key in self.data_file_keys:
            context = self._context(row, key)
            try:
                with _bombs_refused(context):
                    for value in self._values(row, key):
                        self._operator(key).check(value, context)
            except DataError as err:
                self._record(row, key, context.get("file"), str(err))
                return False
        if self.aligned_columns:
            try:
                self._check_aligned(row)
            except DataError as err:
                self._record(row, getattr(err, "key", None), getattr(err, "file", None), str(err))
                return False
        return True

    def _check_aligned(self, row: int) -> None:
        """Each time-aligned input of the row covers its clip (see `aligned_columns`), from the headers or by
        counting frames; a shorter one would be padded, cut or misaligned further on."""
        clip = next((k for k in self.clip_columns if k in self.data_file_keys
                     and self.rows[row].get(k) not in (None, "", [])), None)
        if clip is None or isinstance(self.rows[row][clip], list):
            return
        context = self._context(row, clip)
        length = self._operator(clip).extent(self.rows[row][clip], context)
        if not isinstance(length, Frames):
            return
        frames, clip_file = length.kept, context.get("file")
        for key, fps in self.aligned_columns.items():
            value = self.rows[row].get(key)
            if value in (None, "", []) or isinstance(value, list) or key not in self.data_file_keys:
                continue
            context = self._context(row, key)
            have = self._operator(key).extent(value, context)
            if fps is None and isinstance(have, Frames) and have.available < frames:
                problem = f"has {have.available} frame{'s' if have.available != 1 else ''}, the clip {frames}"
            elif fps is not None and isinstance(have, Seconds) and have.seconds < (need := (frames - 1) / fps):
                problem = f"lasts {have.seconds:.3f} s, the clip's {frames} frames at {fps:g} fps need {need:.3f} s"
            else:
                continue
            err = DataError(f"{self.metadata_path} row {row + 1}: '{key}' {problem} ('{clip}': {clip_file}); give one "
                            f"at least as long as the clip: {context.get('file')}")
            err.key, err.file = key, context.get("file")
            raise err

    def __getitem__(self, index: int) -> dict[str, Any] | None:
        """The item for `index` (mod the row count); None for a row that fails to load when skipping."""
        row = self.row_index(index)
        try:
            return self.load_row(row)
        except DataError as err:
            if self.on_bad_sample == "error":
                raise
            if row not in self._failed:
                self._failed.add(row)
                self._record(row, getattr(err, "key", None), getattr(err, "file", None), str(err))
                warnings.warn(f"skipping bad sample: {err}", stacklevel=2)
            if len(self._failed) == self.num_rows:  # else training would go on with nothing to learn from
                raise DataError(f"{self.metadata_path}: none of its {self.num_rows} usable rows could be loaded "
                                f"(last problem: {one_line(err)})") from None
            return None
