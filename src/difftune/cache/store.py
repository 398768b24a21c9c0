"""The stage-1 store: per-sample dicts of named values, tensors in safetensors shards, the rest in JSON.

Layout (docs/cache_format.md):

    <root>/manifest.json                      what the cache is and what produced it
    <root>/part-<rank>/shard-<k>.safetensors  tensors of a batch of samples, key "<sample_id>/<name>"
    <root>/part-<rank>/shard-<k>.json         the shard's index: every sample's values (JSON ones inline,
                                              tensors as references); renaming it in commits the shard.
                                              Also "sources" (id -> identities of the files the sample was
                                              made from) and "replaces" (id -> earlier shards whose entry
                                              of that sample it supersedes: its files had changed)
    <root>/part-<rank>/complete.json          written by that rank's writer on close()

Nothing here is ever unpickled; a directory holding pickle files is refused outright.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import re
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import DataError  # one line, also when raised in a DataLoader worker
from ..errors import UserError
from ..util import PICKLE_SUFFIXES
from ..io import atomic_write
from .codec import (DTYPES, Encoder as _Encoder, content_of, decode_value as decode, merge_spec, spec_of,  # noqa: F401
                    tensor_refs, tensor_sha256)
from .manifest import (FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, TMP_MARK, CacheManifest, atomic_write_json,
                       canonical_json, fingerprint_diff, read_manifest_json, source_change, source_identity)

PART_RE = re.compile(r"^part-(\d{5,})$")
SHARD_RE = re.compile(r"^shard-(\d{6,})\.(safetensors|json)$")
COMPLETE_NAME = "complete.json"
RAW_DATA_HINTS = ("metadata.csv", "metadata.json", "metadata.jsonl")
STAGE1_HINT = "stage 2 needs the output of --task sft:data_process"


# -- layout -------------------------------------------------------------------------------------------

def part_name(rank: int) -> str:
    return f"part-{rank:05d}"


def shard_stem(number: int) -> str:
    return f"shard-{number:06d}"


def is_temp(name: str) -> bool:
    return name.startswith(".") and TMP_MARK in name


def _owned_in_part(name: str) -> bool:
    return bool(SHARD_RE.match(name)) or name == COMPLETE_NAME or is_temp(name)


def list_parts(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.is_dir() and PART_RE.match(p.name))


def committed_indexes(part: Path) -> list[Path]:
    """Index files of committed shards, in shard order."""
    return sorted(p for p in part.iterdir() if (m := SHARD_RE.match(p.name)) and m.group(2) == "json")


def uncommitted_files(root: Path) -> list[Path]:
    """Temp files and shard tensors without an index: what a killed writer leaves behind."""
    out = [p for p in root.iterdir() if p.is_file() and is_temp(p.name)] if root.is_dir() else []
    for part in list_parts(root):
        names = {p.name for p in part.iterdir()}
        for name in sorted(names):
            m = SHARD_RE.match(name)
            if is_temp(name) or (m and m.group(2) == "safetensors" and f"{shard_stem(int(m.group(1)))}.json"
                                 not in names):
                out.append(part / name)
    return out


def find_pickles(root: Path) -> list[Path]:
    """Files that are (or are named like) pickles: .pt/.pth/.bin/... or starting with a pickle opcode."""
    hits = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            path = Path(dirpath) / name
            if path.suffix.lower() in PICKLE_SUFFIXES:
                hits.append(path)
            elif not (SHARD_RE.match(name) or name in (MANIFEST_NAME, COMPLETE_NAME) or is_temp(name)):
                try:
                    with open(path, "rb") as f:
                        head = f.read(2)
                except OSError:
                    continue
                if len(head) == 2 and head[0] == 0x80 and 2 <= head[1] <= 5:  # PROTO opcode
                    hits.append(path)
    return sorted(hits)


def natural_key(sample_id: str):
    """Sort "row-2" before "row-10"; ties broken by the plain string, so the order is total."""
    parts = re.split(r"(\d+)", sample_id)
    return [int(p) if i % 2 else p for i, p in enumerate(parts)], sample_id


# -- value encoding -----------------------------------------------------------------------------------
# -- shards -------------------------------------------------------------------------------------------

@dataclass
class Shard:
    """A committed shard: its index (parsed) and where its tensors are."""

    part: str
    index_path: Path
    tensor_path: Path | None
    index: dict

    @property
    def name(self) -> str:
        return f"{self.part}/{self.index_path.stem}"


def read_shard(index_path: Path) -> Shard:
    """Parse a shard index; ValueError if it is unreadable or not ours."""
    try:
        index = json.loads(index_path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"{index_path} is unreadable ({type(e).__name__}: {e})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT_NAME:
        raise ValueError(f"{index_path} is not a difftune shard index")
    if index.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{index_path} has format version {index.get('format_version')}, not {FORMAT_VERSION}")
    if not isinstance(index.get("samples"), dict):
        raise ValueError(f"{index_path} has no samples table")
    tensor_file = index.get("tensor_file")
    tensor_path = index_path.parent / tensor_file if tensor_file else None
    return Shard(index_path.parent.name, index_path, tensor_path, index)


def scan_shards(root: Path) -> tuple[list[Shard], list[str]]:
    """All committed shards of all parts, and a problem line for each index that cannot be read."""
    shards, problems = [], []
    for part in list_parts(root):
        for index_path in committed_indexes(part):
            try:
                shards.append(read_shard(index_path))
            except ValueError as e:
                problems.append(str(e))
    return shards, problems


def superseded(shards: list[Shard]) -> set[tuple[str, str]]:
    """(shard name, sample id) of entries that a later stage-1 run replaced because the sample's source
    files had changed: each shard index lists, under "replaces", the earlier shards of the samples it
    re-encoded (or skipped). Appending instead of rewriting keeps every committed file as it was."""
    gone = set()
    for shard in shards:
        for sample_id, names in (shard.index.get("replaces") or {}).items():
            gone.update((name, sample_id) for name in names)
    return gone


def is_complete(root: Path, manifest: CacheManifest) -> tuple[bool, list[str]]:
    """Did every rank of the last writer run close? Returns (complete, parts that did not)."""
    missing = []
    for rank in range(manifest.world_size):
        path = root / part_name(rank) / COMPLETE_NAME
        try:
            done = json.loads(path.read_text())
            if done.get("world_size") != manifest.world_size:
                missing.append(part_name(rank))
        except (OSError, ValueError):
            missing.append(part_name(rank))
    return not missing, missing


# -- the writer ---------------------------------------------------------------------------------------

def _looks_owned_top(name: str, path: Path) -> bool:
    return name == MANIFEST_NAME or is_temp(name) or (path.is_dir() and bool(PART_RE.match(name)))


class CacheWriter:
    """Writes one rank's part of a cache; resumes a cache with the same fingerprint.

    Several processes: each passes its rank and the same `barrier` (e.g. accelerate's wait_for_everyone);
    rank 0 writes the manifest (and removes the old cache on rebuild) before the barrier, the others
    start after it. Samples are buffered and committed a shard at a time (see `flush`).
    """

    def __init__(self, root: str | os.PathLike, *, manifest: CacheManifest, rank: int = 0, world_size: int = 1,
                 rebuild: bool = False, barrier: Callable[[], Any] | None = None,
                 shard_max_bytes: int = 256 << 20, shard_max_samples: int = 1000, flush_seconds: float = 120.0):
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside world size {world_size}")
        self.root = Path(root)
        self.rank, self.world_size = rank, world_size
        self._barrier = barrier or (lambda: None)
        self.shard_max_bytes, self.shard_max_samples = shard_max_bytes, shard_max_samples
        self.flush_seconds = flush_seconds
        manifest = copy.deepcopy(manifest)
        manifest.world_size = world_size
        if self.root.exists() and not self.root.is_dir():
            raise UserError(f"cache directory {self.root} is a file")

        # Read-only checks on every rank while nobody modifies anything, so all ranks raise alike.
        existing = self._check_existing(manifest, rebuild)
        self._barrier()
        if rank == 0:
            if rebuild and self.root.exists():
                remove_cache(self.root)
                existing = None
            if existing is not None:  # resume: keep what the first run knew
                manifest.created_by = existing.created_by
                manifest.frontier = manifest.frontier or existing.frontier
            self.root.mkdir(parents=True, exist_ok=True)
            manifest.save(self.root)
            for part in list_parts(self.root):  # parts no rank of this run owns
                if int(PART_RE.match(part.name).group(1)) >= world_size:
                    self._clean_part(part)
        self._barrier()
        if rank != 0:
            try:
                on_disk = CacheManifest.load(self.root)
            except UserError:
                on_disk = None
            if on_disk is None or on_disk.fingerprint_hash != manifest.fingerprint_hash:
                raise RuntimeError(f"rank {rank}: {self.root / MANIFEST_NAME} is missing or not this run's after "
                                   "the barrier; pass a real barrier (e.g. accelerator.wait_for_everyone)")
            manifest = on_disk
        self.manifest = manifest

        self.part = self.root / part_name(rank)
        self.part.mkdir(parents=True, exist_ok=True)
        self._clean_part(self.part)
        (self.part / COMPLETE_NAME).unlink(missing_ok=True)
        shards, problems = scan_shards(self.root)
        if problems:
            raise UserError(f"the cache at {self.root} has a damaged shard index ({problems[0]}); run "
                            f"`difftune cache verify {self.root}` or rebuild with --rebuild_cache")
        self._done: set[str] = set()
        self._where: dict[str, list[str]] = {}  # committed id -> shards holding its live entry
        self._recorded: dict[str, list[dict]] = {}  # committed id -> identities of its source files
        self._stale: dict[str, list[str]] = {}  # id to re-encode -> shards of the entry it replaces
        self._pending_sources: dict[str, list[dict]] = {}  # id -> identities taken before encoding it
        self._frontier: dict[str, dict | None] = dict(manifest.frontier)
        self._frontier_fixed = bool(manifest.frontier)
        gone = superseded(shards)
        for shard in shards:
            recorded = shard.index.get("sources") or {}
            for sample_id, values in shard.index["samples"].items():
                if (shard.name, sample_id) in gone:
                    continue
                self._done.add(sample_id)
                self._where.setdefault(sample_id, []).append(shard.name)
                if sample_id in recorded:
                    self._recorded[sample_id] = recorded[sample_id]
                if not self._frontier_fixed:
                    for name, enc in values.items():
                        self._frontier.setdefault(name, None)
                        merge_spec(self._frontier, name, spec_of(enc))
        own = [int(SHARD_RE.match(p.name).group(1)) for p in self.part.iterdir() if SHARD_RE.match(p.name)]
        self._next_shard = max(own, default=-1) + 1
        self._reset_buffer()
        self._closed = False

    # -- opening ----------------------------------------------------------------------------------
    def _check_existing(self, manifest: CacheManifest, rebuild: bool) -> CacheManifest | None:
        """The existing cache's manifest when this run resumes it; raises when it must not be touched."""
        root = self.root
        if not root.is_dir():
            return None
        has_manifest = (root / MANIFEST_NAME).exists()
        if not has_manifest:
            if rebuild:
                check_removable(root)
            foreign = sorted(p.name for p in root.iterdir() if not _looks_owned_top(p.name, p))
            if foreign:
                raise UserError(f"{root} is not empty and is not a difftune cache (it holds {', '.join(foreign[:3])}"
                                f"{', ...' if len(foreign) > 3 else ''}); write the cache to a new or empty directory")
            if list_parts(root) and not rebuild:
                raise UserError(f"{root} holds cache parts but no {MANIFEST_NAME}, so what built them is unknown; "
                                "pass --rebuild_cache to rebuild it")
            return None
        data = read_manifest_json(root)  # raises if it is not ours: never overwrite someone else's file
        if rebuild:
            check_removable(root)
            return None
        if data.get("format_version") != FORMAT_VERSION:
            raise UserError(f"the cache at {root} has format version {data.get('format_version')}, this difftune "
                            f"writes {FORMAT_VERSION}; pass --rebuild_cache to rebuild it")
        old = CacheManifest.load(root)
        diffs = []
        if old.family != manifest.family:
            diffs.append(f"family ({old.family} -> {manifest.family})")
        diffs += [f"fingerprint.{d}" for d in fingerprint_diff(old.fingerprint, manifest.fingerprint)]
        if old.frontier and manifest.frontier and old.frontier != manifest.frontier:
            diffs.append("frontier")
        if diffs:
            shown = ", ".join(diffs[:6]) + (f" and {len(diffs) - 6} more" if len(diffs) > 6 else "")
            raise UserError(f"the cache at {root} was built with different settings ({shown}); pass --rebuild_cache "
                            "to rebuild it, or write to another directory")
        return old

    def _clean_part(self, part: Path) -> None:
        """Drop what a killed writer left in `part`: temp files and shard tensors that were never indexed."""
        for path in uncommitted_files(self.root):
            if path.parent == part:
                path.unlink(missing_ok=True)

    # -- writing ----------------------------------------------------------------------------------
    def _reset_buffer(self) -> None:
        self._entries: dict[str, dict] = {}
        self._tensors: dict[str, torch.Tensor] = {}
        self._skipped: dict[str, str] = {}
        self._sources: dict[str, list[dict]] = {}
        self._replaces: dict[str, list[str]] = {}
        self._info: dict[str, dict] = {}
        self._bytes = 0
        self._started: float | None = None

    def done_ids(self) -> set[str]:
        """Ids committed in any part (from earlier runs, any world size, and this writer), less those whose
        source files changed since (see `track_sources`)."""
        return set(self._done)

    def track_sources(self, sources: dict[str, list[str]]) -> dict[str, str]:
        """Before encoding: the source files of each sample id this writer may write. Their identities
        (`source_identity`) are taken now, before encoding reads them, and recorded with each sample. A
        committed sample whose recorded files changed since is taken out of `done_ids()` (so it is encoded
        again and its new entry replaces the old one); returns those ids -> "<file> (<what changed>)".
        Cost: a stat per file of a committed sample, a stat and a sampled hash per file of the rest."""
        changed: dict[str, str] = {}
        for sample_id, files in sources.items():
            if sample_id in self._done:
                for recorded in self._recorded.get(sample_id, ()):
                    what = source_change(recorded)
                    if what is not None and what != "absent":  # absent: the data set check reports it
                        changed[sample_id] = f"{recorded['path']} ({what})"
                        break
                if sample_id not in changed:
                    continue
                self._done.discard(sample_id)
                self._stale[sample_id] = self._where.get(sample_id, [])
            try:
                self._pending_sources[sample_id] = [source_identity(f) for f in files]
            except OSError:
                pass  # a missing file: the sample fails to load and is reported there
        return changed

    def write(self, sample_id: str, values: dict[str, Any], info: dict | None = None) -> None:
        """Add one sample. Buffered; committed with its shard (on size, count, time, `flush` or `close`).
        `info`: JSON about the sample that is not one of its values (e.g. its bucket), read back by `info`."""
        if self._closed:
            raise RuntimeError("CacheWriter.write after close()")
        if not isinstance(sample_id, str) or not sample_id:
            raise ValueError(f"sample id must be a non-empty string, got {sample_id!r}")
        if sample_id in self._done or sample_id in self._entries:
            raise ValueError(f"sample {sample_id!r} is already in the cache at {self.root}; skip the ids in "
                             "done_ids()")
        if not isinstance(values, dict):
            raise TypeError(f"values of sample {sample_id!r} must be a dict, got {type(values).__name__}")
        for name in values:
            if not isinstance(name, str) or not name or name.startswith("_") or "/" in name:
                raise ValueError(f"sample {sample_id!r}: value name {name!r} is not allowed (a non-empty string "
                                 "without '/', not starting with '_', which is reserved for the reader's '_id')")
        tensors: dict[str, torch.Tensor] = {}
        encoder = _Encoder(sample_id, tensors)
        entry = {name: encoder.encode(value, name) for name, value in values.items()}
        self._check_frontier(sample_id, entry)
        self._entries[sample_id] = entry
        if info:
            self._info[sample_id] = json.loads(canonical_json(info))
        self._note_sources(sample_id)
        self._tensors.update(tensors)
        self._bytes += encoder.nbytes
        self._started = self._started or time.monotonic()
        if (self._bytes >= self.shard_max_bytes or len(self._entries) >= self.shard_max_samples
                or time.monotonic() - self._started >= self.flush_seconds):
            self.flush()

    def _check_frontier(self, sample_id: str, entry: dict) -> None:
        if self._frontier or self._frontier_fixed:
            missing = sorted(set(self._frontier) - set(entry))
            extra = sorted(set(entry) - set(self._frontier))
            if missing or extra:
                raise ValueError(f"sample {sample_id!r} does not match the cache's values: missing {missing}, "
                                 f"unexpected {extra}")
        trial = dict(self._frontier)
        for name, enc in entry.items():
            trial.setdefault(name, None)
            conflict = merge_spec(trial, name, spec_of(enc))
            if conflict:
                raise ValueError(f"sample {sample_id!r}: {conflict}")
        if not self._frontier_fixed:
            self._frontier = trial

    def skip(self, sample_id: str, reason: str) -> None:
        """Record that a sample could not be processed (verify counts it; a resumed run retries it)."""
        self._skipped[str(sample_id)] = str(reason)
        self._note_sources(str(sample_id))
        self._started = self._started or time.monotonic()

    def _note_sources(self, sample_id: str) -> None:
        if sample_id in self._pending_sources:
            self._sources[sample_id] = self._pending_sources.pop(sample_id)
        if sample_id in self._stale:  # its old entry (made from the old files) is replaced by this one
            self._replaces[sample_id] = self._stale.pop(sample_id)

    def flush(self) -> None:
        """Commit the buffered samples as one shard: tensors first, then the index (the commit point)."""
        if not self._entries and not self._skipped:
            return
        stem = shard_stem(self._next_shard)
        tensor_file = None
        if self._tensors:
            tensor_file = f"{stem}.safetensors"
            meta = {"format": FORMAT_NAME, "format_version": str(FORMAT_VERSION)}
            atomic_write(self.part / tensor_file, lambda tmp: save_file(self._tensors, str(tmp), metadata=meta),
                         self._bytes, durable=True)  # disk full: one line, not a traceback
        index = {"format": FORMAT_NAME, "format_version": FORMAT_VERSION, "tensor_file": tensor_file,
                 "samples": self._entries, "skipped": self._skipped}
        if self._sources:
            index["sources"] = self._sources
        if self._replaces:
            index["replaces"] = self._replaces
        if self._info:
            index["info"] = self._info
        atomic_write_json(self.part / f"{stem}.json", index, indent=None)  # the commit point
        self._done.update(self._entries)
        for sample_id in self._entries:
            self._where[sample_id] = [f"{self.part.name}/{stem}"]
            if sample_id in self._sources:
                self._recorded[sample_id] = self._sources[sample_id]
        self._next_shard += 1
        self._reset_buffer()

    def close(self) -> None:
        """Commit what is buffered, mark this rank complete, wait for all ranks; rank 0 then records the
        frontier in the manifest if it was not given up front."""
        if self._closed:
            return
        self.flush()
        count = 0
        for index_path in committed_indexes(self.part):
            count += len(read_shard(index_path).index["samples"])
        atomic_write_json(self.part / COMPLETE_NAME, {"rank": self.rank, "world_size": self.world_size,
                                                      "samples": count})
        self._closed = True
        self._barrier()
        if self.rank == 0 and not self.manifest.frontier:
            frontier: dict[str, dict | None] = {}
            shards = scan_shards(self.root)[0]
            gone = superseded(shards)
            for shard in shards:
                for sample_id, values in shard.index["samples"].items():
                    if (shard.name, sample_id) in gone:
                        continue
                    for name, enc in values.items():
                        frontier.setdefault(name, None)
                        merge_spec(frontier, name, spec_of(enc))
            if frontier:
                self.manifest.frontier = {n: s or {"kind": "json"} for n, s in frontier.items()}
                self.manifest.save(self.root)

    def __enter__(self) -> "CacheWriter":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is None:
            self.close()
        elif not self._closed:
            try:  # buffered samples are complete: keep them for the resumed run
                self.flush()
            except Exception:
                pass  # the original exception is the one worth seeing


def check_removable(root: Path) -> None:
    """UserError unless every cache-like thing in `root` is recognisably ours (so deleting it is safe)."""
    root = Path(root)
    if (root / MANIFEST_NAME).exists():
        read_manifest_json(root)  # raises unless it is ours
    else:
        foreign = sorted(p.name for p in root.iterdir() if not _looks_owned_top(p.name, p))
        if foreign:
            raise UserError(f"refusing to delete {root}: it is not a difftune cache (it holds {foreign[0]})")
    for part in list_parts(root):
        foreign = [q.name for q in part.iterdir() if not _owned_in_part(q.name) or q.is_dir()]
        if foreign:
            raise UserError(f"refusing to delete the cache at {root}: {part.name}/{foreign[0]} is not a cache file")


def remove_cache(root: Path) -> None:
    """Delete a cache: only the files it owns (others, e.g. a report next to it, stay)."""
    root = Path(root)
    check_removable(root)
    (root / MANIFEST_NAME).unlink(missing_ok=True)  # first: a half-deleted cache is then never taken as valid
    for path in [p for p in root.iterdir() if _looks_owned_top(p.name, p)]:
        if path.is_dir():
            for q in path.iterdir():
                q.unlink()
            path.rmdir()
        else:
            path.unlink(missing_ok=True)


# -- the reader ---------------------------------------------------------------------------------------

def check_cache_dir(root: Path) -> None:
    """UserError unless `root` is a directory holding a difftune cache and no pickles."""
    if not root.is_dir():
        raise UserError(f"cache directory {root} does not exist" if not root.exists() else
                        f"cache path {root} is a file, not a directory")
    pickles = find_pickles(root)
    if pickles:
        raise UserError(f"{root} holds pickle files ({pickles[0].relative_to(root)}"
                        f"{f' and {len(pickles) - 1} more' if len(pickles) > 1 else ''}); difftune never loads "
                        f"pickles (they can run code) — remove them, or build a cache with --task sft:data_process")
    if not (root / MANIFEST_NAME).exists():
        raw = [n for n in RAW_DATA_HINTS if (root / n).exists()]
        if raw:
            raise UserError(f"{root} looks like a raw dataset (it has {raw[0]}), not a cache; {STAGE1_HINT}")
        raise UserError(f"{root} is not a difftune cache (no {MANIFEST_NAME}); {STAGE1_HINT}")


class CacheReader(torch.utils.data.Dataset):
    """Every committed sample of a cache, each id once, sorted by id (naturally: "2" before "10").

    `reader[i]` is the sample's dict with `_id` added. Tensors are read through memory-mapped safetensors
    opened lazily in the process that reads (safe in DataLoader workers: no handle is ever pickled); each
    tensor's recorded sha256 is checked on its first read in a process.

    `check_sources`: refuse a cache whose samples' source files (recorded by stage 1) are present but
    changed since, naming one; absent ones (the cache was carried elsewhere) only give a note, in `notes`
    and through `log`.
    """

    max_open_files = 64

    def __init__(self, root: str | os.PathLike, *, family: str | None = None, required: Iterable[str] | None = None,
                 allow_incomplete: bool = False, check_sources: bool = True, log: Callable[[str], Any] | None = print):
        self.root = root = Path(root)
        check_cache_dir(root)
        self.manifest = manifest = CacheManifest.load(root)
        if family is not None and manifest.family != family:
            raise UserError(f"the cache at {root} was built for the {manifest.family!r} family, not {family!r}")
        shards, problems = scan_shards(root)
        if problems:
            raise UserError(f"the cache at {root} is damaged ({problems[0]}); run `difftune cache verify {root}`")
        self.complete, unfinished = is_complete(root, manifest)

        files: list[str | None] = []
        where: dict[str, tuple[int, dict, str]] = {}  # id -> (file number, values, shard name)
        sources: dict[str, list[dict]] = {}
        info: dict[str, dict] = {}
        frontier: dict[str, dict | None] = dict(manifest.frontier)
        gone = superseded(shards)
        for shard in shards:
            files.append(str(shard.tensor_path) if shard.tensor_path else None)
            for sample_id, values in shard.index["samples"].items():
                if (shard.name, sample_id) in gone:
                    continue
                sources.setdefault(sample_id, (shard.index.get("sources") or {}).get(sample_id) or [])
                if sample_id in where:
                    if content_of(where[sample_id][1]) != content_of(values):
                        raise UserError(f"the cache at {root} holds sample {sample_id!r} twice with different "
                                        f"content ({where[sample_id][2]} and {shard.name}); rebuild it")
                    continue
                where[sample_id] = (len(files) - 1, values, shard.name)
                info[sample_id] = (shard.index.get("info") or {}).get(sample_id) or {}
                if not manifest.frontier:
                    for name, enc in values.items():
                        frontier.setdefault(name, None)
                        merge_spec(frontier, name, spec_of(enc))
        if not where:
            raise UserError(f"the cache at {root} holds no samples; {STAGE1_HINT} to fill it")
        self.frontier = {n: s or {"kind": "json"} for n, s in frontier.items()}
        missing = [n for n in (required or ()) if n not in self.frontier]
        if missing:
            raise UserError(f"the cache at {root} lacks {', '.join(map(repr, missing))} (it has "
                            f"{', '.join(sorted(self.frontier)) or 'nothing'}); rebuild it with stage 1 set up "
                            "like this run (--rebuild_cache)")
        if not self.complete and not allow_incomplete:
            expected = f" of {manifest.expected_count} expected" if manifest.expected_count is not None else ""
            raise UserError(f"the cache at {root} is incomplete: stage 1 did not finish ({unfinished[0]} never "
                            f"closed; {len(where)} samples{expected}); rerun the same stage 1 command to resume it")
        names = set(self.frontier)
        for sample_id, (_, values, shard_name) in where.items():
            if set(values) != names:
                raise UserError(f"the cache at {root} is inconsistent: sample {sample_id!r} in {shard_name} has "
                                f"{sorted(values)}, expected {sorted(names)}; run `difftune cache verify {root}`")
        self.ids = sorted(where, key=natural_key)
        self.notes: list[str] = []
        if check_sources:
            self._check_sources(sources)
            for note in self.notes:
                if log is not None and os.environ.get("RANK", "0") == "0":
                    log(f"note: {note}")
        self._files = files
        self._samples = [(where[i][0], where[i][1]) for i in self.ids]
        self._info = [info[i] for i in self.ids]
        self._handles: OrderedDict[int, Any] = OrderedDict()
        self._verified: set[tuple[int, str]] = set()  # tensors whose hash this process has checked
        self._pid = os.getpid()

    def __len__(self) -> int:
        return len(self.ids)

    def _check_sources(self, sources: dict[str, list[dict]]) -> None:
        """Stat every recorded source file once (hash only those whose size or mtime moved)."""
        seen: set[str] = set()
        absent: list[str] = []
        for recorded in (r for sample in sources.values() for r in sample):
            path = recorded.get("path")
            if not path or path in seen:
                continue
            seen.add(path)
            what = source_change(recorded)
            if what == "absent":
                absent.append(path)
            elif what is not None:
                raise UserError(f"the cache at {self.root} is stale: {path} changed after stage 1 encoded it ({what}); "
                                "re-run stage 1 (the same command encodes the changed samples again)")
        if absent:
            self.notes.append(f"{len(absent)} of the {len(seen)} source files of the cache at {self.root} are not on "
                              f"this machine (e.g. {absent[0]}), so they cannot be checked for changes since stage 1")

    def _handle(self, file_no: int):
        if self._pid != os.getpid():  # forked: the parent's mmaps are not ours to use
            self._handles, self._pid = OrderedDict(), os.getpid()
        handle = self._handles.get(file_no)
        if handle is None:
            path = self._files[file_no]
            try:
                handle = safe_open(path, framework="pt", device="cpu")
            except Exception as e:  # safetensors raises its own error types
                raise DataError(f"cannot read {path} ({type(e).__name__}: {e}); run "
                                f"`difftune cache verify {self.root}`") from None
            self._handles[file_no] = handle
            while len(self._handles) > self.max_open_files:
                self._handles.popitem(last=False)
        else:
            self._handles.move_to_end(file_no)
        return handle

    def info(self, i: int) -> dict:
        """What stage 1 recorded about sample `i` besides its values (see `CacheWriter.write`)."""
        return self._info[i]

    def json_value(self, i: int, name: str, default=None):
        """A JSON value of sample `i` from its shard index (no tensor is read); `default` if it has none."""
        enc = self._samples[i][1].get(name)
        return default if enc is None or "json" not in enc else decode(enc, lambda key: None)

    def tensor_shapes(self, i: int) -> tuple:
        """(name, shape) of every tensor of sample `i`, from its shard index (no tensor is read)."""
        return tuple(sorted((path, tuple(ref["shape"])) for name, enc in self._samples[i][1].items()
                            for path, ref in tensor_refs(enc, name)))

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"cache index {i} out of range ({len(self)} samples)")
        file_no, values = self._samples[i]
        hashes = {ref["key"]: ref.get("sha256") for name, enc in values.items() for _, ref in tensor_refs(enc, name)}

        def get_tensor(key: str) -> torch.Tensor:
            try:
                t = self._handle(file_no).get_tensor(key)
            except UserError:
                raise
            except Exception as e:  # safetensors raises its own error types
                raise DataError(f"cannot read tensor {key!r} of the cache shard {self._files[file_no]} "
                                f"({type(e).__name__}: {e}); run `difftune cache verify {self.root}`") from None
            # Checked once per tensor and process (a hash costs about what reading the tensor does):
            # a flipped byte stops here, not as a traceback from deep inside the model.
            if (file_no, key) not in self._verified:
                if hashes.get(key) is not None and tensor_sha256(t) != hashes[key]:
                    raise DataError(f"the cache shard {self._files[file_no]} is corrupt: tensor {key!r} does not "
                                    f"match the hash recorded when it was written; run `difftune cache verify "
                                    f"{self.root}`, then rebuild the cache (stage 1 with --rebuild_cache)")
                self._verified.add((file_no, key))
            return t

        out = {name: decode(enc, get_tensor) for name, enc in values.items()}
        out["_id"] = self.ids[i]
        return out

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_handles"] = OrderedDict()  # open files never cross a process boundary
        return state


__all__ = ["CacheWriter", "CacheReader", "remove_cache", "check_removable", "check_cache_dir",
           "natural_key"]
