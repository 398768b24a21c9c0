"""The unified dataset: a metadata file (csv, json or jsonl) whose file fields are relative to a base path.

Each item is the row's columns, with the fields named in `data_file_keys` loaded by the operators, plus
`_row` (the row number) and `_id` (a stable sample id used by the stage-1 cache). `len = rows * repeat`.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from typing import Any

from ..errors import UserError
from .operators import IMAGE_EXTENSIONS, DataOperator, ImageCropAndResize, LoadImage, RouteByExtension, ToAbsolutePath


def _clean(value):
    """pandas gives NaN for empty csv cells and numpy scalars for numbers; return plain Python values."""
    if value is None:
        return None
    if isinstance(value, float) and math.isnan(value):
        return None
    if hasattr(value, "item") and not isinstance(value, (str, bytes)):
        try:
            return value.item()
        except (ValueError, AttributeError):
            return value
    return value


def read_metadata(path: str) -> list[dict[str, Any]]:
    if not os.path.isfile(path):
        raise UserError(f"--dataset_metadata_path {path}: file not found")
    ext = os.path.splitext(path)[1].lower()
    try:
        if ext == ".csv":
            import pandas as pd

            try:
                frame = pd.read_csv(path, keep_default_na=True)
            except pd.errors.EmptyDataError:
                raise UserError(f"{path}: the metadata file is empty") from None
            rows = [{k: _clean(v) for k, v in row.items()} for row in frame.to_dict(orient="records")]
        elif ext == ".json":
            with open(path, encoding="utf-8") as f:
                rows = json.load(f)
            if not isinstance(rows, list) or not all(isinstance(r, dict) for r in rows):
                raise UserError(f"{path}: a .json metadata file must hold a list of objects")
        elif ext == ".jsonl":
            rows = []
            with open(path, encoding="utf-8") as f:
                for n, line in enumerate(f, 1):
                    if line.strip():
                        try:
                            rows.append(json.loads(line))
                        except json.JSONDecodeError as err:
                            raise UserError(f"{path}: line {n} is not valid JSON ({err.msg})") from None
        else:
            raise UserError(f"--dataset_metadata_path {path}: unknown metadata format '{ext}' (use .csv, .json or .jsonl)")
    except UnicodeDecodeError:
        raise UserError(f"{path}: the metadata file is not UTF-8 text") from None
    except json.JSONDecodeError as err:
        raise UserError(f"{path}: not valid JSON ({err.msg} at line {err.lineno})") from None
    if not rows:
        raise UserError(f"{path}: the metadata file has no rows")
    return rows


class UnifiedDataset:
    def __init__(self, base_path: str, metadata_path: str, repeat: int = 1, data_file_keys=("image",),
                 main_data_operator: DataOperator | None = None, special_operator_map: dict | None = None,
                 extra_inputs=(), on_bad_sample: str = "error", present_keys_only: bool = False):
        self.base_path = base_path
        self.metadata_path = metadata_path
        self.repeat = max(1, int(repeat))
        keys = data_file_keys.split(",") if isinstance(data_file_keys, str) else list(data_file_keys)
        self.rows = read_metadata(metadata_path)
        columns = set().union(*(r.keys() for r in self.rows))
        keys = [k.strip() for k in keys if k and k.strip()]
        if present_keys_only:  # the CLI default "image,video" names video even for image data sets
            keys = [k for k in keys if k in columns] or keys
        missing = [k for k in keys if k not in columns]
        if missing:
            raise UserError(f"{metadata_path}: column(s) {missing} named by --data_file_keys are missing "
                            f"(columns: {sorted(columns)})")
        extra = [k.strip() for k in (extra_inputs.split(",") if isinstance(extra_inputs, str) else extra_inputs) if k]
        missing = [k for k in extra if k not in columns]
        if missing:
            raise UserError(f"{metadata_path}: column(s) {missing} named by --extra_inputs are missing")
        self.data_file_keys = keys
        self.main_data_operator = main_data_operator or self.default_image_operator(base_path)
        self.special_operator_map = dict(special_operator_map or {})
        if on_bad_sample not in ("error", "skip"):
            raise UserError(f"--on_bad_sample must be 'error' or 'skip', got {on_bad_sample!r}")
        self.on_bad_sample = on_bad_sample
        self.bad_samples: list[dict] = []
        width = len(str(len(self.rows)))
        self._ids = [f"{i:0{max(6, width)}d}-{self._row_hash(r)}" for i, r in enumerate(self.rows)]

    @staticmethod
    def default_image_operator(base_path: str, height=None, width=None, max_pixels=1024 * 1024,
                               height_division_factor=16, width_division_factor=16) -> DataOperator:
        load = RouteByExtension({tuple(IMAGE_EXTENSIONS): LoadImage()})
        return ToAbsolutePath(base_path) >> load >> ImageCropAndResize(height, width, max_pixels,
                                                                        height_division_factor, width_division_factor)

    @staticmethod
    def _row_hash(row: dict) -> str:
        return hashlib.sha256(json.dumps(row, sort_keys=True, default=str).encode()).hexdigest()[:10]

    @property
    def num_rows(self) -> int:
        return len(self.rows)

    def sample_id(self, index: int) -> str:
        return self._ids[index % len(self.rows)]

    def __len__(self) -> int:
        return len(self.rows) * self.repeat

    def load_row(self, row_index: int) -> dict[str, Any]:
        row = self.rows[row_index]
        where = f"{self.metadata_path} row {row_index + 1}"
        item = dict(row)
        for key in self.data_file_keys:
            op = self.special_operator_map.get(key, self.main_data_operator)
            value = row.get(key)
            if value is None:
                raise UserError(f"{where}: '{key}' is empty")
            item[key] = op(value, {"where": where, "key": key, "row": row_index})
        item["_row"] = row_index
        item["_id"] = self._ids[row_index]
        return item

    def __getitem__(self, index: int) -> dict[str, Any] | None:
        row_index = index % len(self.rows)
        try:
            return self.load_row(row_index)
        except UserError as err:
            if self.on_bad_sample == "error":
                raise
            self.bad_samples.append({"row": row_index + 1, "id": self._ids[row_index], "reason": str(err)})
            return None
