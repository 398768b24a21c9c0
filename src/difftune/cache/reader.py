"""Stage 2's side of the cache: `CacheReader`, every committed sample once, its tensors memory-mapped and checked on
first read; a stale, foreign, incomplete or damaged cache is refused in one line."""

from __future__ import annotations

import os
from collections import OrderedDict
from pathlib import Path
from typing import Any, Callable, Iterable

import torch
from safetensors import safe_open

from ..errors import DataError  # one line, also when raised in a DataLoader worker
from ..errors import UserError
from .codec import content_of, decode_value, merge_spec, spec_of, tensor_refs, tensor_sha256
from .index import (STAGE1_HINT, changed_indexes, check_cache_dir, is_complete, missing_shards, natural_key,
                    scan_shards, superseded)
from .manifest import CacheManifest, source_change

# -- the reader ---------------------------------------------------------------------------------------

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
        gone_files = missing_shards(root, shards) if self.complete else []
        if gone_files and not allow_incomplete:
            more = f" (+{len(gone_files) - 1} more)" if len(gone_files) > 1 else ""
            raise UserError(f"the cache at {root} is missing committed shards: {gone_files[0]}{more}; copy the whole "
                            f"cache (or rerun stage 1), and see `difftune cache verify {root}`")

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
        # last: an index edited to agree with a cut tensor passes every check above (a more particular one speaks
        # first where it finds something)
        changed = changed_indexes(root, shards) if self.complete else []
        if changed:
            raise UserError(f"the cache at {root} was changed after stage 1 wrote it: {changed[0]}")
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
        return default if enc is None or "json" not in enc else decode_value(enc, lambda key: None)

    def tensor_shapes(self, i: int) -> tuple:
        """(name, shape) of every tensor of sample `i`, from its shard index (no tensor is read)."""
        return tuple(sorted((path, tuple(ref["shape"])) for name, enc in self._samples[i][1].items()
                            for path, ref in tensor_refs(enc, name)))

    def __getitem__(self, i: int) -> dict[str, Any]:
        if not -len(self) <= i < len(self):
            raise IndexError(f"cache index {i} out of range ({len(self)} samples)")
        file_no, values = self._samples[i]
        refs = {ref["key"]: ref for name, enc in values.items() for _, ref in tensor_refs(enc, name)}

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
            # The shape, dtype and finiteness too (`cache verify`'s checks): bytes reshaped keep their hash.
            if (file_no, key) not in self._verified:
                from .verify import tensor_problems

                ref = refs.get(key)
                if ref is not None and ref.get("sha256") is not None and tensor_sha256(t) != ref["sha256"]:
                    raise DataError(f"the cache shard {self._files[file_no]} is corrupt: tensor {key!r} does not "
                                    f"match the hash recorded when it was written; run `difftune cache verify "
                                    f"{self.root}`, then rebuild the cache (stage 1 with --rebuild_cache)")
                problems = tensor_problems(t, ref, check_hash=False) if ref is not None else []
                if problems:
                    raise DataError(f"the cache shard {self._files[file_no]} is damaged: tensor {key!r} "
                                    f"{problems[0]}; run `difftune cache verify {self.root}`, then rebuild the "
                                    f"cache (stage 1 with --rebuild_cache)")
                self._verified.add((file_no, key))
            return t

        out = {name: decode_value(enc, get_tensor) for name, enc in values.items()}
        out["_id"] = self.ids[i]
        return out

    def __getstate__(self) -> dict:
        state = self.__dict__.copy()
        state["_handles"] = OrderedDict()  # open files never cross a process boundary
        return state




__all__ = ["CacheReader"]
