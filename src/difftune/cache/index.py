"""The cache on disk: its layout (docs/cache_format.md), its committed shards and their indexes, what is complete.

    <root>/manifest.json                      what the cache is and what produced it (manifest.py)
    <root>/part-<rank>/shard-<k>.safetensors  tensors of a batch of samples, key "<sample_id>/<name>"
    <root>/part-<rank>/shard-<k>.json         the shard's index: every sample's values (JSON ones inline,
                                              tensors as references: codec.py); renaming it in commits the shard.
                                              Also "sources" (id -> identities of the files the sample was
                                              made from) and "replaces" (id -> earlier shards whose entry
                                              of that sample it supersedes: its files had changed)
    <root>/part-<rank>/complete.json          written by that rank's writer on close()

The writer (writer.py) adds shards, the reader (reader.py) and `difftune cache verify` (verify.py) read them.
Nothing here is ever unpickled; a directory holding pickle files is refused outright.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path

from ..errors import UserError
from ..util import PICKLE_SUFFIXES
from .manifest import FORMAT_NAME, FORMAT_VERSION, MANIFEST_NAME, TMP_MARK, CacheManifest

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


def _inside(name: str, folder: Path) -> bool:
    """`name` is a file of `folder` itself (links followed; `./x` and `a/../x` are `x`): an index names its tensor
    file, never another place."""
    return os.path.dirname(os.path.realpath(folder / name)) == os.path.realpath(folder)


def _linked_out(part: Path) -> str | None:
    """Where a part folder really is, when that is not inside its cache folder (a link to another place)."""
    real, root = os.path.realpath(part), os.path.realpath(part.parent)
    return None if os.path.dirname(real) == root else real


def read_shard(index_path: Path) -> Shard:
    """Parse a shard index; ValueError if it is unreadable or not ours."""
    linked = _linked_out(index_path.parent)
    if linked is not None:  # as a shard file that is a link out of the cache: the folder is refused the same
        raise ValueError(f"{index_path.parent}: the part folder is a link to {linked}, outside the cache folder")
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
    if tensor_file is not None and (not isinstance(tensor_file, str) or not tensor_file.strip()):
        raise ValueError(f"{index_path}: its tensor_file {tensor_file!r} is no file name")
    if tensor_file is None and _holds_tensors(index["samples"]):
        raise ValueError(f"{index_path}: its samples hold tensors, and it names no tensor_file")
    if tensor_file is not None and not _inside(tensor_file, index_path.parent):
        raise ValueError(f"{index_path}: its tensor_file {tensor_file!r} points outside the cache folder")
    tensor_path = index_path.parent / os.path.normpath(tensor_file) if tensor_file is not None else None
    return Shard(index_path.parent.name, index_path, tensor_path, index)


def _holds_tensors(samples: dict) -> bool:
    from .codec import tensor_refs

    return any(isinstance(values, dict) and any(next(iter(tensor_refs(enc, name)), None) is not None
                                                for name, enc in values.items() if isinstance(enc, dict))
               for values in samples.values())


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


def missing_shards(root: Path, shards: list[Shard]) -> list[str]:
    """What is gone from a finished cache (a partial copy): a part whose committed shards hold fewer samples than its
    writer counted on close, a committed shard whose tensor file is absent. One line each, as `verify` says them."""
    problems = []
    found: dict[str, int] = {}
    for shard in shards:
        found[shard.part] = found.get(shard.part, 0) + len(shard.index["samples"])
        if shard.tensor_path is not None and not shard.tensor_path.is_file():
            problems.append(f"{shard.name}: tensor file {shard.tensor_path.name} is missing")
    for part in list_parts(root):
        try:
            claimed = json.loads((part / COMPLETE_NAME).read_text()).get("samples")
        except (OSError, ValueError, AttributeError):
            continue  # an unfinished part: is_complete says so
        if isinstance(claimed, int) and claimed != found.get(part.name, 0):
            problems.append(f"{part.name}: its writer committed {claimed} samples, {found.get(part.name, 0)} found")
    return problems


def index_digest(index_path: Path) -> str:
    """sha256 of a committed shard index's bytes: its writer seals it in complete.json on close."""
    import hashlib

    return hashlib.sha256(index_path.read_bytes()).hexdigest()


def changed_indexes(root: Path, shards: list[Shard]) -> list[str]:
    """Committed shard indexes that are not what their writer sealed on close (complete.json's "indexes"): an entry
    edited since (a latent cut together with its shape and hash in the index passes every per-tensor check), or a
    shard added to a closed part. One line each; parts sealed by an older difftune (no "indexes") are not checked."""
    problems = []
    sealed: dict[str, dict | None] = {}
    for shard in shards:
        if shard.part not in sealed:
            try:
                recorded = json.loads((root / shard.part / COMPLETE_NAME).read_text()).get("indexes")
            except (OSError, ValueError, AttributeError):
                recorded = None
            sealed[shard.part] = recorded if isinstance(recorded, dict) else None
        recorded = sealed[shard.part]
        if recorded is None:
            continue
        name = shard.index_path.name
        if name not in recorded:
            problems.append(f"{shard.index_path}: added after its writer closed {shard.part} (its complete.json does "
                            f"not list it): rebuild the cache (stage 1 with --rebuild_cache)")
        elif index_digest(shard.index_path) != recorded[name]:
            problems.append(f"{shard.index_path}: changed after its writer committed it (not what {shard.part}/"
                            f"{COMPLETE_NAME} sealed): rebuild the cache (stage 1 with --rebuild_cache)")
    return problems


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


