"""`difftune cache verify <dir>`: read a whole cache and report what is wrong with it, without changing it.

Checks: the manifest, pickle files, counts (expected vs found, per part), that every sample has every
frontier name with the manifest's kind/dtype, the number of dims per name, NaN/Inf, that shard files are
readable, complete and match the hashes recorded at write time, duplicates, and what a killed writer left.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import safe_open

from ..errors import UserError
from .manifest import CacheManifest
from .codec import content_of, merge_spec, spec_of, tensor_refs, tensor_sha256
from .index import (COMPLETE_NAME, Shard, changed_indexes, committed_indexes, find_pickles, is_complete,
                    list_parts, read_shard, superseded, uncommitted_files)

MAX_PROBLEMS = 200  # a broken cache can have one problem per sample; the first ones tell the story


@dataclass
class VerifyReport:
    root: str
    problems: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    samples: int = 0
    shards: int = 0
    parts: int = 0
    family: str | None = None
    hidden_problems: int = 0

    @property
    def ok(self) -> bool:
        return not self.problems and not self.hidden_problems

    @property
    def summary(self) -> str:
        what = f"{self.samples} samples in {self.shards} shards, {self.parts} parts"
        if self.family:
            what += f", family {self.family}"
        if self.ok:
            return f"cache at {self.root} is OK: {what}"
        n = len(self.problems) + self.hidden_problems
        return f"cache at {self.root} has {n} problem{'s' if n != 1 else ''}: {what}"

    def add(self, problem: str) -> None:
        if len(self.problems) < MAX_PROBLEMS:
            self.problems.append(problem)
        else:
            self.hidden_problems += 1

    def __str__(self) -> str:
        lines = [self.summary] + [f"  problem: {p}" for p in self.problems]
        if self.hidden_problems:
            lines.append(f"  ... and {self.hidden_problems} more problems")
        return "\n".join(lines + [f"  note: {n}" for n in self.notes])


def tensor_problems(t: torch.Tensor, ref: dict, check_hash: bool = True) -> list[str]:
    """What is wrong with a stored tensor against its index entry: dtype and shape, the recorded hash, NaN / Inf.
    `cache verify` and the stage-2 reader both run it."""
    problems = []
    dtype = str(t.dtype).removeprefix("torch.")
    if dtype != ref["dtype"] or list(t.shape) != list(ref["shape"]):
        problems.append(f"stored as {dtype}{list(t.shape)}, index says {ref['dtype']}{list(ref['shape'])}")
    if check_hash and tensor_sha256(t) != ref.get("sha256"):
        problems.append("content does not match the hash recorded when it was written (corrupt file?)")
    if t.is_floating_point():
        finite = torch.isfinite(t.float()) if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else torch.isfinite(t)
        bad = int((~finite).sum())
        if bad:
            nans = int(torch.isnan(t.float()).sum())
            problems.append(f"{nans} NaN and {bad - nans} Inf value(s)")
    return problems


def _check_tensor(report: VerifyReport, where: str, ref: dict, handle, spec: dict | None) -> torch.Tensor | None:
    try:
        t = handle.get_tensor(ref["key"])
    except Exception as e:  # safetensors has its own error types
        report.add(f"{where}: tensor {ref['key']!r} unreadable ({type(e).__name__}: {e})")
        return None
    dtype = str(t.dtype).removeprefix("torch.")
    problems = tensor_problems(t, ref)
    if problems and problems[0].startswith("stored as"):
        report.add(f"{where}: {problems.pop(0)}")
    if spec and spec.get("kind") == "tensor" and spec["dtype"] != dtype:
        report.add(f"{where}: dtype {dtype}, manifest says {spec['dtype']}")
    for problem in problems:
        report.add(f"{where}: {problem}")
    return t


def _open(path: Path):
    # Our own check first: it names the problem better than the library's message.
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        n = int.from_bytes(head, "little") if len(head) == 8 else -1
        if n < 0 or 8 + n > size:
            raise ValueError(f"truncated ({size} bytes, header claims {n})")
        header = json.loads(f.read(n))
    end = max((v["data_offsets"][1] for k, v in header.items() if k != "__metadata__"), default=0)
    if 8 + n + end != size:
        raise ValueError(f"truncated or padded: {size} bytes, expected {8 + n + end}")
    return safe_open(str(path), framework="pt", device="cpu")


def verify_cache(root) -> VerifyReport:
    """Read every file of the cache at `root`; return a report (never raises for a broken cache)."""
    root = Path(root)
    report = VerifyReport(str(root))
    if not root.is_dir():
        report.add(f"{root} is not a directory")
        return report
    for path in find_pickles(root):
        report.add(f"pickle file {path.relative_to(root)} (difftune never loads pickles)")
    try:
        manifest = CacheManifest.load(root)
    except UserError as e:
        report.add(f"manifest: {e}")
        return report
    report.family = manifest.family
    frontier: dict[str, dict | None] = dict(manifest.frontier)
    infer = not manifest.frontier
    for path in uncommitted_files(root):
        report.add(f"orphan file {path.relative_to(root)} (left by an interrupted writer; the next writer run "
                   "removes it)")
    complete, unfinished = is_complete(root, manifest)
    if not complete:
        report.add(f"stage 1 has not finished: {', '.join(unfinished)} never closed (rerun stage 1 to resume)")

    seen: dict[str, tuple[dict, str]] = {}
    skipped: dict[str, str] = {}
    ndims: dict[str, tuple[int, str]] = {}
    parts = list_parts(root)
    shards = []
    for part in parts:
        for index_path in committed_indexes(part):
            try:
                shards.append(read_shard(index_path))
            except ValueError:
                pass  # reported below
    gone = superseded(shards)  # entries a later stage-1 run re-encoded (their source files had changed)
    report.parts = len(parts)
    for part in parts:
        in_part = 0
        for index_path in committed_indexes(part):
            try:
                shard = read_shard(index_path)
            except ValueError as e:
                report.add(str(e))
                continue
            report.shards += 1
            in_part += len(shard.index["samples"])
            skipped.update(shard.index.get("skipped") or {})
            _verify_shard(report, shard, frontier, infer, seen, ndims, gone)
        marker = part / COMPLETE_NAME
        if marker.exists():
            try:
                claimed = json.loads(marker.read_text()).get("samples")
            except (OSError, ValueError):
                claimed = None
                report.add(f"{part.name}/{COMPLETE_NAME} is unreadable")
            if claimed is not None and claimed != in_part:
                report.add(f"{part.name}: its writer committed {claimed} samples, {in_part} found")
    if complete:
        for problem in changed_indexes(root, shards):
            report.add(problem)
    report.samples = len(seen)
    if infer:
        for name, spec in frontier.items():
            if spec is None:
                report.notes.append(f"value {name!r} is None in every sample")
    names = set(frontier)
    for sample_id, (values, shard_name) in seen.items():
        missing, extra = sorted(names - set(values)), sorted(set(values) - names)
        if missing or extra:
            report.add(f"{shard_name} sample {sample_id!r}: missing {missing}, unexpected {extra}")
    skipped = {k: v for k, v in skipped.items() if k not in seen}
    if skipped:
        report.notes.append(f"{len(skipped)} sample(s) skipped by stage 1, e.g. {next(iter(skipped))!r}: "
                            f"{next(iter(skipped.values()))}")
    if manifest.expected_ids is not None:
        absent = [i for i in manifest.expected_ids if i not in seen and i not in skipped]
        if absent:
            report.add(f"{len(absent)} expected sample(s) missing, e.g. {', '.join(map(repr, absent[:5]))}")
        unexpected = [i for i in seen if i not in set(manifest.expected_ids)]
        if unexpected:
            report.notes.append(f"{len(unexpected)} sample(s) not in the expected ids, e.g. {unexpected[0]!r}")
    elif manifest.expected_count is not None and len(seen) + len(skipped) < manifest.expected_count:
        report.add(f"expected {manifest.expected_count} samples, found {len(seen)}"
                   + (f" (+{len(skipped)} skipped)" if skipped else ""))
    return report


def _verify_shard(report: VerifyReport, shard: Shard, frontier: dict, infer: bool, seen: dict, ndims: dict,
                  gone: set) -> None:
    handle = None
    if shard.tensor_path is not None:
        try:
            handle = _open(shard.tensor_path)
        except FileNotFoundError:
            report.add(f"{shard.name}: tensor file {shard.tensor_path.name} is missing")
        except Exception as e:
            report.add(f"{shard.name}: tensor file {shard.tensor_path.name} is unreadable ({e})")
    for sample_id, values in shard.index["samples"].items():
        if (shard.name, sample_id) in gone:
            continue
        if sample_id in seen:
            first, where = seen[sample_id]
            if content_of(first) != content_of(values):
                report.add(f"sample {sample_id!r} is in {where} and {shard.name} with different content")
            else:
                report.notes.append(f"sample {sample_id!r} is in both {where} and {shard.name} (same content; "
                                    "read once)")
            continue
        seen[sample_id] = (values, shard.name)
        for name, enc in values.items():
            where = f"{shard.name} sample {sample_id!r} value {name!r}"
            spec = spec_of(enc)
            if infer:
                frontier.setdefault(name, None)
                conflict = merge_spec(frontier, name, spec)
                if conflict:
                    report.add(f"{shard.name} sample {sample_id!r}: {conflict}")
            elif name in frontier and spec is not None and frontier[name] is not None \
                    and spec["kind"] != frontier[name]["kind"]:
                report.add(f"{where}: kind {spec['kind']}, manifest says {frontier[name]['kind']}")
            for path, ref in tensor_refs(enc, name):
                if handle is None:
                    if shard.tensor_path is None:
                        report.add(f"{where}: refers to a tensor but the shard has no tensor file")
                    continue
                t = _check_tensor(report, f"{shard.name} sample {sample_id!r} value {path!r}", ref, handle,
                                  frontier.get(name) if path == name else None)
                if t is not None:
                    first = ndims.setdefault(path if path == name else name + "[...]", (t.dim(), sample_id))
                    if path == name and first[0] != t.dim():
                        report.add(f"{where}: {t.dim()} dims, sample {first[1]!r} has {first[0]}")


__all__ = ["verify_cache", "VerifyReport"]
