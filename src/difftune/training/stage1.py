"""Split training's data side: stage 1 (`*:data_process`) runs the stage-1 units over every row once and writes
the frontier of each sample to a cache; stage 2 (`*:train`) reads it back (`open_cache`).

Which units run where and what is cached is computed by `core/graph.py`; the recipe (`recipe.py`) decides
which stages a task runs.
"""

from __future__ import annotations

import gc
import os
from pathlib import Path
from typing import Any

import torch

from ..core.batch import split_batch
from ..errors import UserError
from ..cache.codec import to_cache
from .builders import bad_samples_of_all_processes, make_dataset, stage_pipeline, write_json
from .accelerator import main_process_log
from .config import flag_text
from .setup import ensure_writable, stage_settings

CACHE_SUBDIR = "cache"


def stage1_fingerprint(run) -> dict:
    """What produced the cache: the weights of the stage-1 models, pre-processing settings, the pipeline class, the
    features and the unit set (the run's features' only: adding a feature to a family leaves this cache valid)."""
    from ..cache import file_identity as _file_identity

    config, split = run.config, run.split
    weights = {}
    for name, model in run.models:
        if name in split.stage1_models:
            files = model.resolve()
            files = files if isinstance(files, (list, tuple)) else [files]
            weights[name] = [_file_identity(f) for f in files if os.path.isfile(f)]
    data_files = []
    if config.dataset_metadata_path and os.path.isfile(config.dataset_metadata_path):
        data_files.append(_file_identity(config.dataset_metadata_path))
    elif config.dataset_metadata_path and os.path.isdir(config.dataset_metadata_path):  # a caption folder
        from ..data.dataset import caption_files

        data_files.extend(_file_identity(f) for f in caption_files(config.dataset_metadata_path))
    # The metadata's identity holds only its name: the same metadata in another folder names other images.
    root = config.dataset_base_path or os.path.dirname(config.dataset_metadata_path or "")
    # how a stage-1 model's weights are stored changes its outputs: FP8, or 4 bits (--quant_options)
    storage = {name: "fp8" if model.wants_fp8(name) else f"{model.quant.method}/{','.join(model.quant.keep)}"
               for name, model in run.models if name in split.stage1_models
               and (model.wants_fp8(name) or model.quant is not None)}
    return {
        "family": run.family.name,
        "pipeline": run.pipeline.__name__,
        "features": sorted(run.features),
        "weights": weights,
        **({"storage": storage} if storage else {}),
        "torch_dtype": config.torch_dtype,
        "metadata": data_files,
        "data_root": os.path.abspath(root),
        "preprocessing": {"height": config.height, "width": config.width, "max_pixels": config.max_pixels,
                          **(config.frames.as_dict() if config.frames else {}),  # video families only
                          # the flags' text, as the fingerprint held it before they were parsed
                          "data_file_keys": flag_text(config.data_file_keys),
                          "extra_inputs": flag_text(config.extra_inputs),
                          # the settings stage 1's units read (run-time settings of stage 2 stay out)
                          **{k: v for k, v in stage_settings(config, run.family).items()
                             if k != "batch_size" and any(k in u.reads() for u in split.stage1)}},
        "units": [f"{u.name}@{getattr(u, 'version', 1)}" for u in split.stage1],
        "frontier": list(split.frontier),
        "task": config.task.split(":")[0],
    }


def stage1_models(run) -> dict:
    """slot -> what made the cached values, for the manifest: each stage-1 model's recognised class and config, its
    files and the cached values its units wrote (stage 2 checks its own models against these)."""
    import json

    out = {}
    for slot in run.split.stage1_models:
        det = run.detected.get(slot)
        if det is None:
            continue
        values = sorted({n for u in run.split.stage1 if slot in u.models for n in u.writes()
                         if n in run.split.frontier})
        out[slot] = {"class": det.spec.class_name, "config": json.loads(json.dumps(det.config, default=str)),
                     "files": [os.path.abspath(f) for f in det.files], "values": values}
    return out


def run_stage1(run, output_path: str) -> dict:
    """Stage 1: run the stage-1 units over every row once and write the frontier per sample to `output_path`."""
    from ..cache import CacheManifest, CacheWriter

    config, family, split, accelerator = run.config, run.family, run.split, run.accelerator
    ensure_writable(output_path)
    log = main_process_log(accelerator)
    log(f"split: {split.describe()}")
    dataset = make_dataset(run)
    rows = dataset.num_rows
    if config.dataset_repeat != 1:
        log(f"note: stage 1 encodes each of the {rows} rows once; --dataset_repeat applies in stage 2")
    fingerprint = stage1_fingerprint(run)
    manifest = CacheManifest.new(family=family.name, frontier={}, fingerprint=fingerprint, expected_count=rows,
                                 models=stage1_models(run))
    writer = CacheWriter(output_path, manifest=manifest, rank=accelerator.process_index,
                         world_size=accelerator.num_processes, rebuild=config.rebuild_cache,
                         barrier=accelerator.wait_for_everyone, shard_max_samples=max(1, int(config.cache_commit_every)))
    pipe = stage_pipeline(run, set(split.stage1_models))
    pipe.scheduler.set_training()
    settings = stage_settings(config, family)
    from .losses import all_losses

    cfg = all_losses(run.family)[run.task.loss].cfg  # a loss that reads the negative side: stage 1 computes it too
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
    explicit = config.data_process_batch_size is not None
    batch_size = max(1, int(config.data_process_batch_size or AUTO_BATCH))
    one_at_a_time = False  # set once a batch runs out of GPU memory

    def encode(samples: list[dict]) -> None:
        nonlocal one_at_a_time
        if len(samples) > 1 and not one_at_a_time:
            try:
                return encode_together(samples)
            except torch.OutOfMemoryError:
                one_at_a_time = True
                if torch.cuda.is_available():
                    torch.cuda.empty_cache()
                log(f"stage 1: {len(samples)} samples encoded together ran out of GPU memory; encoding one at a time "
                    f"from here (--data_process_batch_size 1 says so up front)")
        for sample in samples:
            encode_together([sample])

    def encode_together(samples: list[dict]) -> None:
        nonlocal written
        values = pipe.training_inputs_batch(samples)
        values.update({k: v for k, v in settings.items() if k != "batch_size"})
        values["batch_size"] = len(samples)
        pipe.run_units(values, split.stage1, cfg=cfg)
        for sample, per_sample in zip(samples, split_batch(values, len(samples), pipe.batching, split.frontier)):
            # the sample's bucket as one-stage training sees it, so stage 2 forms the same batches
            writer.write(sample["_id"], to_cache(per_sample), info={"bucket": sample["_bucket"]})
            written += 1

    # Rows are loaded by DataLoader workers; samples of equal size are encoded together in batches.
    loader = torch.utils.data.DataLoader(_RowSubset(dataset, todo), batch_size=None, shuffle=False,
                                         num_workers=min(config.dataset_num_workers, os.cpu_count() or 1),
                                         collate_fn=lambda x: x)
    buckets: dict[tuple, list[dict]] = {}
    with torch.no_grad():
        for row, sample in tqdm(zip(todo, loader), total=len(todo), desc="stage 1",
                                disable=config.no_progress or not accelerator.is_main_process):
            if sample is None or sample.get("_id") != dataset.sample_id(row):  # a bad row the user asked to skip
                writer.skip(dataset.sample_id(row), "bad sample (see bad_samples.json)")
                continue
            # the training buckets (shapes from the headers), refined by what else the family must share
            signature = pipe.batch_signature(sample)
            sample["_bucket"] = dataset.row_shape(sample["_row"])
            bucket = buckets.setdefault((sample["_bucket"], signature), [])
            bucket.append(sample)
            limit = batch_size if explicit else auto_batch_size(sample)
            if len(bucket) >= limit or signature is None:  # None: the family encodes one at a time
                encode(bucket)
                bucket.clear()
        for bucket in buckets.values():
            if bucket:
                encode(bucket)
    writer.close()
    if config.validation_prompts and accelerator.is_main_process:
        from .validation import write_cached_prompts

        write_cached_prompts(output_path, pipe, config.validation_prompts, run.models)
    accelerator.wait_for_everyone()
    bad = bad_samples_of_all_processes(accelerator, dataset.bad_samples)
    if bad and accelerator.is_main_process:
        report = Path(output_path) / "bad_samples.json"
        write_json(report, bad)
        log(f"skipped {len(bad)} bad sample(s), listed in {report}")
    del pipe
    gc.collect()
    return {"written": written, "skipped_done": len(mine) - len(todo), "cache": output_path,
            "stage1_models": list(split.stage1_models)}


# Without --data_process_batch_size, samples of equal size are encoded together up to AUTO_BATCH of them and
# AUTO_PIXELS pixels in all. On an H200 at 1024x1024, eight at once were 1.03x as fast as one at a time for 4.8x the
# GPU memory (docs/benchmarks.md, GPU); on CPUs small images gain (1.85x at 256x256) and large ones little.
AUTO_BATCH = 8
AUTO_PIXELS = 1 << 20


def sample_pixels(value) -> int:
    """The pixels a loaded input holds: an image's, the frames' of a clip or of a list of images (0 for the rest)."""
    from PIL import Image

    if isinstance(value, Image.Image):
        return value.width * value.height
    if isinstance(value, dict):
        return sum(sample_pixels(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return sum(sample_pixels(v) for v in value)
    return 0


def auto_batch_size(sample: dict) -> int:
    """How many samples like `sample` stage 1 encodes together by default."""
    return max(1, min(AUTO_BATCH, AUTO_PIXELS // max(1, sample_pixels(sample))))


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
        return self.reader[i % len(self.reader)]

    def bucket_keys(self, columns=()) -> list:
        """Per sample index: the bucket stage 1 recorded (else the shapes of its cached tensors, which may split
        buckets finer) and the values of `columns`, read from the shard indexes without opening a tensor."""
        per = [(_hashable(self.reader.info(i).get("bucket")) or self.reader.tensor_shapes(i),
                tuple(_hashable(self.reader.json_value(i, c, default=None)) for c in columns))
               for i in range(len(self.reader))]
        return [per[i % len(per)] for i in range(len(self))]


def _hashable(value):
    return tuple(_hashable(v) for v in value) if isinstance(value, (list, tuple)) else value


def open_cache(run, log=print):
    from ..cache import CacheReader

    config = run.config
    if config.dataset_metadata_path:
        raise UserError("--task *:train reads the stage-1 cache in --dataset_base_path; remove --dataset_metadata_path")
    reader = CacheReader(config.dataset_base_path, family=run.family.name, required=run.split.frontier, log=log)
    check_size_flags(config, reader.manifest.fingerprint.get("preprocessing") or {}, config.dataset_base_path)
    return RepeatedCache(reader, config.dataset_repeat)


def check_size_flags(config, cached: dict, root) -> None:
    """Stage 2 trains on the sizes stage 1 cached: a size flag given now with another value would be ignored, so it is
    refused in one line naming both values. (--max_pixels is checked only when it differs from its default, which a
    stage-2 command copied without the flag has.)"""
    import dataclasses

    from .config import RunConfig

    default_pixels = {f.name: f.default for f in dataclasses.fields(RunConfig)}["max_pixels"]
    frames = (config.frames.as_dict() if config.frames else {}).get("num_frames")
    given = {"height": config.height, "width": config.width, "num_frames": config.num_frames and frames,
             "max_pixels": config.max_pixels if config.max_pixels != default_pixels else None}
    for flag, value in given.items():
        if value is None or flag not in cached or cached[flag] == value:
            continue
        was = f"--{flag} {cached[flag]}" if cached[flag] is not None else f"no --{flag}"
        raise UserError(f"--{flag} {value}: the cache at {root} was made with {was}, and stage 2 trains on the "
                        f"cached {'clips' if flag == 'num_frames' else 'sizes'}; drop the flag, or rebuild the cache "
                        f"with it (stage 1 with --rebuild_cache)")


__all__ = ["CACHE_SUBDIR", "open_cache", "run_stage1", "stage1_fingerprint", "stage1_models"]
