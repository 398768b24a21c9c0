"""Split training: stage 1 (`*:data_process`) writes the frontier of every sample to a cache; stage 2
(`*:train`) trains from it; `*:split` runs both in one command.

Which units run where and what is cached is computed by `pipelines/graph.py`; this module runs stage 1
over the data set and opens the cache for stage 2.
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path
from typing import Any

import torch

from .. import __version__
from ..errors import UserError
from ..pipelines import get_family, split_batch
from ..pipelines.images import IMAGE_MARK, images_to_cache

CACHE_SUBDIR = "cache"


def stage1_fingerprint(args, pipe_cls, split, components) -> dict:
    """What produced the cache: the weights of the stage-1 models, pre-processing settings, the unit set."""
    from ..cache import file_identity as _file_identity
    from .run import stage_settings

    weights = {}
    for name, config in components:
        if name in split.stage1_models:
            files = config.resolve()
            files = files if isinstance(files, (list, tuple)) else [files]
            weights[name] = [_file_identity(f) for f in files if os.path.isfile(f)]
    data_files = []
    if args.dataset_metadata_path and os.path.isfile(args.dataset_metadata_path):
        data_files.append(_file_identity(args.dataset_metadata_path))
    # The metadata's identity holds only its name: the same metadata in another folder names other images.
    root = args.dataset_base_path or os.path.dirname(args.dataset_metadata_path or "")
    return {
        "family": pipe_cls.family,
        "weights": weights,
        "torch_dtype": args.torch_dtype,
        "metadata": data_files,
        "data_root": os.path.abspath(root),
        "preprocessing": {"height": args.height, "width": args.width, "max_pixels": args.max_pixels,
                          "data_file_keys": args.data_file_keys, "extra_inputs": args.extra_inputs,
                          "edit_image_auto_resize": stage_settings(args)["edit_image_auto_resize"]},
        "units": [f"{u.name}@{getattr(u, 'version', 1)}" for u in split.stage1],
        "frontier": list(split.frontier),
        "task": args.task.split(":")[0],
    }


def _cacheable(values: dict[str, Any]) -> dict[str, Any]:
    """Stage-1 values -> what the store accepts: tensors (CPU) and JSON values; images as uint8 tensors."""
    out: dict[str, Any] = {}
    for key, value in values.items():
        value = images_to_cache(value)
        if isinstance(value, dict) and IMAGE_MARK in value:
            out[key] = value[IMAGE_MARK]
            out[f"{key}{IMAGE_MARK}"] = bool(value["single"])
        elif isinstance(value, torch.Tensor):
            out[key] = value.detach().to("cpu").contiguous()
        else:
            out[key] = value
    return out


def _from_cache(sample: dict[str, Any]) -> dict[str, Any]:
    out = {}
    for key, value in sample.items():
        if key.endswith(IMAGE_MARK):
            continue
        flag = sample.get(f"{key}{IMAGE_MARK}")
        out[key] = {IMAGE_MARK: value, "single": flag} if flag is not None else value
    return out


def run_data_process(args, task, accelerator=None, output_path: str | None = None) -> dict:
    """Stage 1: run the stage-1 units over every row once and write the frontier per sample."""
    from ..cache import CacheManifest, CacheWriter
    from .run import build_pipeline, compute_split, make_accelerator, make_dataset, resolve_components, stage_settings

    from .run import ensure_writable

    output_path = output_path or args.output_path
    ensure_writable(output_path)
    accelerator = accelerator or make_accelerator(args, None)
    log = print if accelerator.is_main_process else (lambda *a, **k: None)
    pipe_cls = get_family(args.family)
    split = compute_split(pipe_cls, args, task)
    log(f"split: {split.describe()}")
    components = resolve_components(args)
    dataset = make_dataset(args, pipe_cls)
    rows = dataset.num_rows if hasattr(dataset, "num_rows") else len(dataset) // max(1, args.dataset_repeat)
    if args.dataset_repeat != 1:
        log(f"note: stage 1 encodes each of the {rows} rows once; --dataset_repeat applies in stage 2")
    fingerprint = stage1_fingerprint(args, pipe_cls, split, components)
    manifest = CacheManifest.new(family=pipe_cls.family, frontier={}, fingerprint=fingerprint,
                                 expected_count=rows)
    writer = CacheWriter(output_path, manifest=manifest, rank=accelerator.process_index,
                         world_size=accelerator.num_processes, rebuild=args.rebuild_cache,
                         barrier=accelerator.wait_for_everyone,
                         shard_max_samples=max(1, int(getattr(args, "cache_commit_every", 64) or 64)))
    pipe = build_pipeline(args, components, set(split.stage1_models), accelerator.device, log=log)
    pipe.scheduler.set_training()
    settings = stage_settings(args)
    mine = [i for i in range(rows) if i % accelerator.num_processes == accelerator.process_index]
    # Each sample records its source files' identities; a cached one whose files changed since (replaced
    # images, same metadata) is encoded again, not kept.
    if hasattr(dataset, "source_files"):
        changed = writer.track_sources({dataset.sample_id(i): dataset.source_files(dataset.row_index(i))
                                        for i in mine})
        if changed:
            log(f"encoding {len(changed)} cached sample(s) again: their source files changed since, e.g. "
                f"{next(iter(changed.values()))}")
    done = set(writer.done_ids())
    todo = [i for i in mine if dataset.sample_id(i) not in done]
    if len(todo) < len(mine):
        log(f"resuming stage 1: {len(mine) - len(todo)} sample(s) already cached")
    from tqdm.auto import tqdm

    written = 0
    batch_size = max(1, int(getattr(args, "data_process_batch_size", 1) or 1))

    def encode(samples: list[dict]) -> None:
        nonlocal written
        values = pipe.training_inputs_batch(samples)
        values.update({k: v for k, v in settings.items() if k != "batch_size"})
        values["batch_size"] = len(samples)
        pipe.run_units(values, split.stage1)
        for sample, per_sample in zip(samples, split_batch(values, len(samples), pipe.padded_values, split.frontier)):
            writer.write(sample["_id"], _cacheable(per_sample))
            written += 1

    # Rows are loaded by DataLoader workers; samples of equal size are encoded together in batches.
    loader = torch.utils.data.DataLoader(_RowSubset(dataset, todo), batch_size=None, shuffle=False,
                                         num_workers=min(args.dataset_num_workers, os.cpu_count() or 1),
                                         collate_fn=lambda x: x)
    buckets: dict[tuple, list[dict]] = {}
    with torch.no_grad():
        for row, sample in tqdm(zip(todo, loader), total=len(todo), desc="stage 1",
                                disable=args.no_progress or not accelerator.is_main_process):
            if sample is None or sample.get("_id") != dataset.sample_id(row):  # a bad row the user asked to skip
                writer.skip(dataset.sample_id(row), "bad sample (see bad_samples.json)")
                continue
            signature = pipe.batch_signature(sample)
            bucket = buckets.setdefault(signature, [])
            bucket.append(sample)
            if len(bucket) >= batch_size or signature is None:  # None: the family encodes one at a time
                encode(bucket)
                bucket.clear()
        for bucket in buckets.values():
            if bucket:
                encode(bucket)
    writer.close()
    if args.validation_prompts and accelerator.is_main_process and pipe.models.get("text_encoder") is not None:
        from .validation import parse_prompts, write_cached_prompts

        vae_files = [f for name, c in components if name == "vae"
                     for f in (c.resolve() if isinstance(c.resolve(), list) else [c.resolve()])]
        write_cached_prompts(output_path, pipe, parse_prompts(args.validation_prompts), vae_files)
    accelerator.wait_for_everyone()
    from .run import bad_samples_of_all_processes

    bad = bad_samples_of_all_processes(accelerator, getattr(dataset, "bad_samples", None) or [])
    if bad and accelerator.is_main_process:
        from .run import _write_json

        report = Path(output_path) / "bad_samples.json"
        _write_json(report, bad)
        log(f"skipped {len(bad)} bad sample(s), listed in {report}")
    del pipe
    gc.collect()
    return {"written": written, "skipped_done": len(mine) - len(todo), "cache": output_path,
            "stage1_models": list(split.stage1_models)}


class _RowSubset(torch.utils.data.Dataset):
    def __init__(self, dataset, rows: list[int]):
        self.dataset, self.rows = dataset, rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.dataset[self.rows[i]]


class RepeatedCache(torch.utils.data.Dataset):
    """The cache read `repeat` times per epoch (index i -> sample i mod n, like the raw data set)."""

    def __init__(self, reader, repeat: int):
        self.reader, self.repeat = reader, max(1, int(repeat))

    def __len__(self):
        return len(self.reader) * self.repeat

    def __getitem__(self, i):
        return _from_cache(self.reader[i % len(self.reader)])


def open_cache(args, pipe_cls, split):
    from ..cache import CacheReader

    if args.dataset_metadata_path:
        raise UserError("--task *:train reads the stage-1 cache in --dataset_base_path; remove --dataset_metadata_path")
    reader = CacheReader(args.dataset_base_path, family=pipe_cls.family, required=split.frontier)
    return RepeatedCache(reader, args.dataset_repeat)


def run_split(args, task) -> dict:
    """Both stages in one command: stage 1 into <output_path>/cache, models freed, then stage 2."""
    import copy

    from .run import TaskSpec, make_accelerator, run_train

    accelerator = make_accelerator(args, args.output_path)
    cache_dir = os.path.join(args.output_path, CACHE_SUBDIR)
    stage1 = run_data_process(args, TaskSpec(task.loss, "data_process"), accelerator=accelerator,
                              output_path=cache_dir)
    gc.collect()
    stage2_args = copy.copy(args)
    stage2_args.dataset_base_path = cache_dir
    stage2_args.dataset_metadata_path = None
    summary = run_train(stage2_args, TaskSpec(task.loss, "train"), accelerator=accelerator)
    summary["stage1"] = stage1
    return summary


__all__ = ["run_data_process", "open_cache", "run_split", "CACHE_SUBDIR", "__version__"]
