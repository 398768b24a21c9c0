"""Stage 1's side of the cache: `CacheWriter` adds committed shards (atomic: tensors, then the index renamed in),
resumes by sample id, refuses a cache made with other settings unless told to rebuild it; `remove_cache`."""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path
from typing import Any, Callable

import torch
from safetensors.torch import save_file

from ..errors import UserError
from ..io import atomic_write
from .codec import Encoder, merge_spec, spec_of
from .index import (COMPLETE_NAME, PART_RE, SHARD_RE, _owned_in_part, committed_indexes, index_digest,
                    is_temp, list_parts, part_name, read_shard, scan_shards, shard_stem, superseded,
                    uncommitted_files)
from .manifest import (FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, CacheManifest, atomic_write_json, canonical_json,
                       fingerprint_diff, read_manifest_json, source_change, source_identity)

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
        encoder = Encoder(sample_id, tensors)
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
        count, sealed = 0, {}
        for index_path in committed_indexes(self.part):
            count += len(read_shard(index_path).index["samples"])
            sealed[index_path.name] = index_digest(index_path)  # committed indexes never change: sealed here
        atomic_write_json(self.part / COMPLETE_NAME, {"rank": self.rank, "world_size": self.world_size,
                                                      "samples": count, "indexes": sealed})
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



__all__ = ["CacheWriter", "check_removable", "remove_cache"]
