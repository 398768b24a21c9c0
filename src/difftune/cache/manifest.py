"""The cache manifest (`manifest.json`) and the fingerprint that ties a cache to what produced it.

A stale cache is worse than none: it trains silently on latents of another resolution or another VAE
(peers.md §2 items 1-7). So every cache records a fingerprint (weights identity, pre-processing settings,
unit set — whatever the caller says produced it), and a writer or reader compares it before use.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..errors import UserError

FORMAT_NAME = "difftune-cache"
FORMAT_VERSION = 1
MANIFEST_NAME = "manifest.json"
TMP_MARK = ".tmp-"  # every temp file the cache writes has this in its name (see atomic_write)
KINDS = ("tensor", "json", "tree")  # tree: a list/dict that holds tensors


def _version() -> str:
    from ..version import __version__

    return __version__


# -- atomic files -------------------------------------------------------------------------------------

def atomic_write_bytes(final: str | os.PathLike, data: bytes) -> None:
    """`data` to `final` durably through a temp file (see `io.atomic_write`): an OS error (disk full, ...) is
    one UserError line naming `final` and the size, with the earlier file as it was and no temp file left."""
    from ..io import atomic_write

    atomic_write(final, lambda tmp: tmp.write_bytes(data), len(data), durable=True)


def atomic_write_json(final: str | os.PathLike, obj: Any, indent: int | None = 1) -> None:
    text = json.dumps(obj, indent=indent, ensure_ascii=False, allow_nan=False,
                      separators=None if indent else (",", ":"))
    atomic_write_bytes(final, (text + "\n").encode())


# -- fingerprint --------------------------------------------------------------------------------------

def canonical_json(obj: Any) -> str:
    """Stable JSON: sorted keys, no whitespace, tuples as lists; refuses values JSON cannot hold."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False)


def fingerprint_hash(fingerprint: dict) -> str:
    """sha256 of the canonical JSON of `fingerprint` (key order and tuple-vs-list do not matter)."""
    return hashlib.sha256(canonical_json(fingerprint).encode()).hexdigest()


def file_identity(path: str | os.PathLike, *, blocks: int = 8, block_size: int = 1 << 16) -> dict:
    """Name, size and a sha256 over the safetensors header (when it is one) and `blocks` evenly spaced
    blocks of the file. Cheap on multi-GB weights, yet it tells apart two fine-tunes of one architecture,
    whose headers (names, shapes, offsets) are identical."""
    path = Path(path)
    size = path.stat().st_size
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        start = 0
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else 0
        if path.suffix == ".safetensors" and 8 + n <= size:
            f.seek(0)
            digest.update(f.read(8 + n))
            start = 8 + n
        span = max(0, size - start - block_size)
        for i in range(blocks):
            f.seek(start + (span * i // max(1, blocks - 1)))
            digest.update(f.read(block_size))
    return {"file": path.name, "size": size, "sampled_sha256": digest.hexdigest()}


SOURCE_BLOCKS = 4  # 64 KiB blocks sampled per source file: the first, the last and two between


def source_identity(path: str | os.PathLike) -> dict:
    """What a cached sample was made from: the file's absolute path, size, mtime and a sha256 of sampled
    blocks (`file_identity`). Cheap: one stat and at most 256 KiB read."""
    path = os.path.abspath(path)
    stat = os.stat(path)
    return {"path": path, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "sha256": file_identity(path, blocks=SOURCE_BLOCKS)["sampled_sha256"]}


def source_change(recorded: dict) -> str | None:
    """How a source file differs from its recorded identity: None (unchanged), "absent" (not here, e.g.
    the cache was carried to another machine), or what changed. Same size and mtime: unchanged without
    reading it; a new mtime with the same size and sampled content (a copy, a touch) counts as unchanged."""
    try:
        stat = os.stat(recorded["path"])
        if stat.st_size == recorded.get("size") and stat.st_mtime_ns == recorded.get("mtime_ns"):
            return None
        if stat.st_size != recorded.get("size"):
            return f"{recorded.get('size')} -> {stat.st_size} bytes"
        if file_identity(recorded["path"], blocks=SOURCE_BLOCKS)["sampled_sha256"] != recorded.get("sha256"):
            return "same size, different content"
        return None
    except OSError:
        return "absent"


def _short(value: Any, limit: int = 60) -> str:
    text = canonical_json(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def fingerprint_diff(old: Any, new: Any, prefix: str = "") -> list[str]:
    """Dotted paths where two fingerprints differ, with the old -> new value for short leaves."""
    old, new = json.loads(canonical_json(old)), json.loads(canonical_json(new))
    if isinstance(old, dict) and isinstance(new, dict):
        out = []
        for key in sorted(set(old) | set(new)):
            path = f"{prefix}.{key}" if prefix else str(key)
            if key not in old:
                out.append(f"{path} (added)")
            elif key not in new:
                out.append(f"{path} (removed)")
            else:
                out.extend(fingerprint_diff(old[key], new[key], path))
        return out
    if old == new:
        return []
    name = prefix or "fingerprint"
    if isinstance(old, (dict, list)) or isinstance(new, (dict, list)):
        return [name]
    return [f"{name} ({_short(old)} -> {_short(new)})"]


# -- manifest -----------------------------------------------------------------------------------------

def check_frontier(frontier: dict, where: str) -> dict[str, dict]:
    if not isinstance(frontier, dict):
        raise ValueError(f"{where}: frontier must be a dict name -> spec")
    out = {}
    for name, spec in frontier.items():
        if not isinstance(spec, dict) or spec.get("kind") not in KINDS:
            raise ValueError(f"{where}: frontier[{name!r}] must be {{'kind': one of {KINDS}}}, got {spec!r}")
        if spec["kind"] == "tensor" and not isinstance(spec.get("dtype"), str):
            raise ValueError(f"{where}: frontier[{name!r}] is a tensor without a 'dtype'")
        out[str(name)] = dict(spec)
    return out


@dataclass
class CacheManifest:
    """What a cache is: its family, the values each sample holds (the frontier) and what produced it.

    `frontier` may be left empty when the caller does not know dtypes in advance: the writer then takes it
    from the samples it writes and records it on `close()`.
    """

    family: str
    fingerprint: dict
    frontier: dict[str, dict] = field(default_factory=dict)
    expected_count: int | None = None
    expected_ids: list[str] | None = None
    format_version: int = FORMAT_VERSION
    created_by: str = field(default_factory=lambda: f"difftune {_version()}")
    world_size: int = 1  # of the last writer run; the reader uses it to tell whether every rank finished
    # slot -> what made the cached values: {"class", "config", "files", "values"} of each stage-1 model (the family's
    # recognised class and config, its weight files, the cached values its units wrote); stage 2 checks that its
    # models fit them. {} in a cache written before it was recorded.
    models: dict = field(default_factory=dict)

    @classmethod
    def new(cls, *, family: str, fingerprint: dict, frontier: dict | None = None,
            expected_count: int | None = None, expected_ids=None, models: dict | None = None) -> "CacheManifest":
        ids = None if expected_ids is None else [str(i) for i in expected_ids]
        if ids is not None and expected_count is None:
            expected_count = len(ids)
        canonical_json(fingerprint)  # fail now, not when the manifest is saved
        return cls(family=family, fingerprint=json.loads(canonical_json(fingerprint)),
                   frontier=check_frontier(frontier or {}, "CacheManifest"),
                   expected_count=expected_count, expected_ids=ids,
                   models=json.loads(canonical_json(models or {})))

    @property
    def fingerprint_hash(self) -> str:
        return fingerprint_hash(self.fingerprint)

    def to_json(self) -> dict:
        return {"format": FORMAT_NAME, "format_version": self.format_version, "family": self.family,
                "created_by": self.created_by, "world_size": self.world_size, "frontier": self.frontier,
                "fingerprint": self.fingerprint, "fingerprint_hash": self.fingerprint_hash,
                "expected_count": self.expected_count, "expected_ids": self.expected_ids, "models": self.models}

    def save(self, root: str | os.PathLike) -> None:
        atomic_write_json(Path(root) / MANIFEST_NAME, self.to_json())

    @classmethod
    def load(cls, root: str | os.PathLike) -> "CacheManifest":
        """Read `<root>/manifest.json`; UserError if it is missing, unreadable or not a difftune cache."""
        path = Path(root) / MANIFEST_NAME
        data = read_manifest_json(root)
        version = data.get("format_version")
        if version != FORMAT_VERSION:
            raise UserError(f"the cache at {root} has format version {version}; this difftune ({_version()}) "
                            f"reads version {FORMAT_VERSION}: rebuild it (stage 1 with --rebuild_cache)")
        try:
            manifest = cls(family=str(data["family"]), fingerprint=data["fingerprint"],
                           frontier=check_frontier(data.get("frontier") or {}, str(path)),
                           expected_count=data.get("expected_count"), expected_ids=data.get("expected_ids"),
                           format_version=version, created_by=str(data.get("created_by", "?")),
                           world_size=int(data.get("world_size", 1)), models=dict(data.get("models") or {}))
        except (KeyError, TypeError, ValueError) as e:
            raise UserError(f"{path} is malformed ({type(e).__name__}: {e})") from None
        if data.get("fingerprint_hash") != manifest.fingerprint_hash:
            raise UserError(f"{path} is corrupt: its fingerprint does not match its fingerprint_hash")
        return manifest


def read_manifest_json(root: str | os.PathLike) -> dict:
    """The raw manifest of any format version; UserError if missing, unreadable or not ours."""
    path = Path(root) / MANIFEST_NAME
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise UserError(f"{root} is not a difftune cache (no {MANIFEST_NAME})") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{path} is unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise UserError(f"{path} is not a difftune cache manifest (no \"format\": \"{FORMAT_NAME}\")")
    return data


__all__ = ["CacheManifest", "fingerprint_hash", "file_identity", "source_identity", "source_change",
           "fingerprint_diff", "canonical_json", "FORMAT_NAME", "FORMAT_VERSION", "MANIFEST_NAME", "atomic_write_json",
           "atomic_write_bytes", "read_manifest_json"]
