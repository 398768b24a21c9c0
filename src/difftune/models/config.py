"""`ModelConfig`: where one model's weights are (local paths or a hub id + file pattern), and the CLI parsers.

    ModelConfig("models/x/vae/diffusion_pytorch_model.safetensors")          # a file
    ModelConfig("models/x/transformer")                                       # a folder (its safetensors)
    ModelConfig(["a-00001-of-00002.safetensors", "a-00002-of-00002.safetensors"])   # shards
    ModelConfig(model_id="Qwen/Qwen-Image", origin_file_pattern="transformer/diffusion_pytorch_model*.safetensors")
    ModelConfig(model_id="Qwen/Qwen-Image", origin_file_pattern="tokenizer/")   # a folder: resolves to it
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from collections.abc import Sequence
from pathlib import Path

from ..errors import UserError
from ..util import names as split_names
from . import download


@dataclass
class ModelConfig:
    path: str | list[str] | None = None
    model_id: str | None = None
    origin_file_pattern: str | None = None
    download_source: str | None = None  # "huggingface" (default) or "modelscope"; None: DIFFTUNE_DOWNLOAD_SOURCE
    local_model_path: str | None = None  # None: DIFFTUNE_MODEL_BASE_PATH, else ./models
    skip_download: bool | None = None  # None: DIFFTUNE_SKIP_DOWNLOAD
    fp8: bool = False  # store this (frozen) model's Linear weights in float8_e4m3fn
    # Component names (dit, text_encoder, vae) that are stored in FP8 if this entry turns out to be one of them:
    # `--fp8_models dit` is known before the weights are recognised.
    fp8_components: tuple[str, ...] = ()
    quant: object = None  # a models.quant.QuantOption: Linear weights stored in 4 bits (--quant_options)
    decode_prequantized: bool = False  # a pre-quantised file's weights decoded in full (a fully trained model)
    _resolved: list[str] | str | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self):
        if self.path is not None and self.model_id is not None:
            raise UserError(f"ModelConfig: give a path or a model_id, not both (path={self.path!r}, "
                            f"model_id={self.model_id!r})")
        if self.path is None:
            if not self.model_id or not self.origin_file_pattern:
                raise UserError("ModelConfig: give a path (file, folder or list of shards) or a model_id with an "
                                "origin_file_pattern")
        elif isinstance(self.path, (list, tuple)):
            if not self.path:
                raise UserError("ModelConfig: the list of shard paths is empty")
            self.path = [os.fspath(p) for p in self.path]
        else:
            self.path = os.fspath(self.path)
        if self.download_source is not None:
            self.download_source = download.download_source(self.download_source)

    # -- description ---------------------------------------------------------------------------------
    def describe(self) -> str:
        if self.model_id is not None:
            return f"{self.model_id}:{self.origin_file_pattern}"
        if isinstance(self.path, list):
            return self.path[0] if len(self.path) == 1 else f"{self.path[0]} (+{len(self.path) - 1} shards)"
        return self.path

    def describe_files(self) -> list[str]:
        """What to show a user, without downloading anything."""
        if self._resolved is not None:
            return list(self._resolved) if isinstance(self._resolved, list) else [self._resolved]
        if self.model_id is not None:
            return [self.describe()]
        return list(self.path) if isinstance(self.path, list) else [self.path]

    def matches(self, entry: str | list[str]) -> bool:
        """Whether a `--fp8_models` entry names this config (the same string, a shard, or the shards' folder)."""
        if self.model_id is not None:
            return isinstance(entry, str) and entry.strip() == self.describe()
        norm = os.path.normpath
        mine = [norm(p) for p in (self.path if isinstance(self.path, list) else [self.path])]
        if isinstance(entry, list):
            return sorted(norm(e) for e in entry) == sorted(mine)
        entry = norm(entry.strip())
        return entry in mine or (len(mine) > 1 and all(os.path.dirname(p) == entry for p in mine))

    def wants_fp8(self, component: str | None = None) -> bool:
        return self.fp8 or (component is not None and component in self.fp8_components)

    # -- resolution ----------------------------------------------------------------------------------
    def resolve(self) -> list[str] | str:
        """Local weight files (a list), or a folder for configs that name one (tokenizer, processor).

        Hub ids are looked up locally first and downloaded only when missing (see `download`).
        """
        if self._resolved is None:
            self._resolved = self._resolve_path() if self.model_id is None else download.resolve_hub(
                self.model_id, self.origin_file_pattern, base=download.model_base_path(self.local_model_path),
                skip=download.skip_download(self.skip_download),
                source=download.download_source(self.download_source))
        return self._resolved

    def _resolve_path(self) -> list[str] | str:
        if isinstance(self.path, list):
            for p in self.path:
                if not os.path.isfile(p):
                    raise UserError(f"{p}: no such file" + (" (a list of paths must list shard files, not folders)"
                                                            if os.path.isdir(p) else ""))
            return list(self.path)
        path = os.path.expanduser(self.path)
        if os.path.isfile(path):
            return [path]
        if not os.path.isdir(path):
            raise UserError(f"{path}: no such file or directory")
        index = download.shard_index(Path(path))
        if index:  # the indexed shards (a stray consolidated copy beside them is not loaded twice); the
            # loader names any that are missing
            present = [os.path.join(path, n) for n in sorted(index) if os.path.isfile(os.path.join(path, n))]
            if present:
                return present
        names = sorted(os.listdir(path))
        weights = [n for n in names if n.lower().endswith(download.WEIGHT_SUFFIXES)]
        weights = weights or [n for n in names if n.lower().endswith(download.PICKLE_SUFFIXES)]
        return [os.path.join(path, n) for n in weights] if weights else path


# -- CLI flags -------------------------------------------------------------------------------------------

def parse_model_configs(model_paths_json: str | None = None, model_id_with_origin_paths: str | None = None,
                        fp8_models: str | None = None, slots: Sequence[str] | None = None,
                        quant_options: str | None = None) -> list[ModelConfig]:
    """ModelConfigs from `--model_paths` (a JSON list of paths or lists of shard paths),
    `--model_id_with_origin_paths` (comma-separated `model_id:pattern`) and `--fp8_models`.

    A `--fp8_models` entry is the string of a model entry (a path, a shard of a list entry, the folder of a
    list's shards, or `model_id:pattern`) or a slot name of the family (`slots`, e.g. `dit`; with `slots` None,
    before the family is known, any other name is taken as a slot and `check_fp8_slots` checks it later); a JSON
    list matches a list entry.
    """
    configs: list[ModelConfig] = []
    if model_paths_json is not None and model_paths_json.strip():
        try:
            entries = json.loads(model_paths_json)
        except json.JSONDecodeError as e:
            raise UserError(f"--model_paths: invalid JSON ({e.msg} at line {e.lineno} column {e.colno}, char {e.pos}); "
                            f"expected a list of paths or of lists of shard paths, e.g. "
                            f"'[\"vae.safetensors\", [\"dit-1.safetensors\", \"dit-2.safetensors\"]]'") from e
        if isinstance(entries, str):
            entries = [entries]
        if not isinstance(entries, list):
            raise UserError(f"--model_paths: expected a JSON list, got a JSON {type(entries).__name__}")
        for i, entry in enumerate(entries):
            shards = isinstance(entry, list) and entry and all(isinstance(p, str) for p in entry)
            if not (isinstance(entry, str) or shards):
                raise UserError(f"--model_paths: entry {i} ({json.dumps(entry)[:80]}) is not a path or a non-empty "
                                f"list of shard paths")
            configs.append(ModelConfig(path=entry))
    for item in split_names(model_id_with_origin_paths):
        model_id, sep, pattern = item.partition(":")
        if not sep or not model_id.strip() or not pattern.strip():
            raise UserError(f"--model_id_with_origin_paths: entry {item!r} is not model_id:file_pattern, e.g. "
                            f"owner/model:transformer/diffusion_pytorch_model*.safetensors")
        configs.append(ModelConfig(model_id=model_id.strip(), origin_file_pattern=pattern.strip()))
    apply_fp8(configs, fp8_models, slots)
    if quant_options:
        from .quant import apply_quant_options

        apply_quant_options(configs, quant_options)
    return configs


def apply_fp8(configs: list[ModelConfig], fp8_models: str | None, slots: Sequence[str] | None) -> None:
    if fp8_models is None or not fp8_models.strip():
        return
    text = fp8_models.strip()
    if text.startswith("["):
        try:
            entries = json.loads(text)
        except json.JSONDecodeError as e:
            raise UserError(f"--fp8_models: invalid JSON ({e.msg} at line {e.lineno} column {e.colno})") from e
        entries = entries if isinstance(entries, list) else [entries]
    else:
        entries = split_names(text)
    names = None if slots is None else list(slots)
    for entry in entries:
        hits = [c for c in configs if c.matches(entry)]
        if hits:
            for c in hits:
                c.fp8 = True
            continue
        if isinstance(entry, str) and (entry.isidentifier() if names is None else entry in names):
            for c in configs:
                c.fp8_components = tuple(dict.fromkeys(c.fp8_components + (entry,)))
            continue
        raise UserError(f"--fp8_models: {json.dumps(entry)} matches no entry of --model_paths or "
                        f"--model_id_with_origin_paths and is not a model slot ({', '.join(names or ())})")


def check_fp8_slots(configs: list[ModelConfig], slots: Sequence[str]) -> None:
    """`--fp8_models` names taken as slots before the family was known must be slots of the family."""
    for config in configs:
        for name in config.fp8_components:
            if name not in slots:
                raise UserError(f"--fp8_models: {name!r} matches no entry of --model_paths or "
                                f"--model_id_with_origin_paths and is not a model slot ({', '.join(slots)})")
