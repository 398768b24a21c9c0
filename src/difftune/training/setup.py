"""Setting a run up from its configuration, before any model is loaded: the family and its models (recognised from
the weights); the family's options; the pipeline class and the features the run uses (from its data columns, flags
and models; in stage 2, from the cache that stage 1 wrote); the split. (The accelerator is `accelerator.py`'s.)

Everything a stage needs afterwards travels in one `Run`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core.build import context_of
from ..core.features import describe
from ..core.family import FamilySpec, recognise
from ..core.graph import Split, split_units
from ..errors import UserError
from .config import RunConfig, TaskSpec


@dataclass
class Run:
    """One training command, set up: what every stage reads."""

    config: RunConfig
    task: TaskSpec
    family: FamilySpec
    models: list  # (slot, ModelConfig) for every model the flags name
    detected: dict  # slot -> DetectedComponent (config, files)
    pipeline: type  # the family's pipeline class, or a variant's
    features: frozenset[str]
    split: Split
    accelerator: Any
    log: Any = print

    def replace(self, **changes) -> Run:
        return dataclasses.replace(self, **changes)


def setup(config: RunConfig, accelerator, log=print) -> Run:
    """The run's family, models, pipeline class, features and split (nothing is loaded)."""
    from ..models import check_fp8_slots, parse_model_configs

    configs = parse_model_configs(config.model_paths, config.model_id_with_origin_paths, config.fp8_models,
                                  quant_options=config.quant_options)
    family, found = recognise(configs, config.family, log=log)
    check_fp8_slots(configs, family.slots)
    check_storage(found)
    config = config.with_family(family)
    check_offload_flags(config)
    task = config.task_spec
    check_task(task, family)
    if task.stage == "train":
        pipeline, features = features_of_cache(config.dataset_base_path, family)
    else:
        context = context_of(found, data_columns(config), config.family_options)
        pipeline = family.pipeline_for(context)
        features = pipeline.resolve_features(context)
        pipeline.check_run(context, features)
        pipeline.check_features(context, features)
        for column in unread_file_columns(config, pipeline):
            log(f"note: '{column}' is loaded (--data_file_keys) but not handed to the pipeline (--extra_inputs does "
                f"not name it): it is ignored, as the reference's train.py ignores it")
    # stage 2: the denoiser fits the models whose values the cache holds (one release's text encoder's prompts do not
    # train another release's DiT of the same family)
    cached = cached_models(config.dataset_base_path, family) if task.stage == "train" else {}
    pipeline.check_models({**cached, **{s: d for s, _, d in found}})
    if pipeline is not family.pipeline:
        log(f"pipeline: {pipeline.__name__} (recognised from the weights and data)")
    log(f"features: {describe(features)}")
    split = compute_split(pipeline, features, config, task)
    return Run(config, task, family, [(s, c) for s, c, _ in found], {s: d for s, _, d in found}, pipeline,
               features, split, accelerator, log)


def check_storage(found) -> None:
    """One model, one storage: `--fp8_models` naming its slot and a `--quant_options` entry naming its file would
    have the fp8 storage win and the quantisation dropped."""
    for slot, model, _ in found:
        if model.quant is not None and model.wants_fp8(slot):
            raise UserError(f"--quant_options {model.describe()}:{model.quant.method} and --fp8_models {slot} name "
                            f"the same model ({slot}); choose one storage")


def check_offload_flags(config: RunConfig) -> None:
    from .offload import model_offload_requested

    if config.cpu_offload_split_threshold is not None and not model_offload_requested(config):
        raise UserError(f"--cpu_offload_split_threshold {config.cpu_offload_split_threshold:g}: it sets how model "
                        f"offload streams a block, and no model is offloaded; add --enable_model_cpu_offload or "
                        f"--blocks_to_swap N, or drop it")


def check_task(task: TaskSpec, family: FamilySpec) -> None:
    """A loss of another family's (FamilySpec.losses) is refused."""
    from .losses import LOSSES, all_losses

    if task.loss not in LOSSES and task.loss not in dict(family.losses):
        owner = next((f.name for f in _families() if task.loss in dict(f.losses)), "?")
        raise UserError(f"--task {task.loss}: a task of the {owner} family; the {family.name} family does not have it")
    assert task.loss in all_losses()


def _families():
    from ..core.family import families

    return families().values()


def data_columns(config: RunConfig) -> frozenset[str]:
    """The data columns a run hands to its pipeline: --extra_inputs, as the reference's train.py (a column named only
    in --data_file_keys is loaded but reaches no unit, so it switches no feature on: `unread_file_columns`)."""
    return frozenset(config.extra_inputs)


def unread_file_columns(config: RunConfig, pipeline: type) -> list[str]:
    """Columns --data_file_keys loads from the metadata that neither --extra_inputs nor the pipeline's own inputs
    name: the reference loads and ignores them, and so does difftune, with a note."""
    if not config.dataset_metadata_path or not os.path.exists(config.dataset_metadata_path):
        return []
    from ..data.dataset import read_metadata

    header = {k for row in read_metadata(config.dataset_metadata_path) for k in row}
    handed = set(config.extra_inputs) | set(pipeline.data_inputs)
    return [c for c in config.data_file_keys if c in header and c not in handed]


def features_of_cache(path: str, family: FamilySpec) -> tuple[type, frozenset[str]]:
    """Stage 2: the pipeline class and features stage 1 recorded in the cache."""
    from ..cache import CacheManifest
    from ..cache.index import check_cache_dir

    check_cache_dir(Path(path))  # a raw data set or an unfinished cache is named as such
    manifest = CacheManifest.load(path)
    if manifest.family != family.name:
        raise UserError(f"the cache at {path} was built for the {manifest.family!r} family, not {family.name!r}")
    recorded = manifest.fingerprint.get("features")
    if recorded is None:
        raise UserError(f"the cache at {path} records no features (an older difftune wrote it): rebuild it with "
                        f"stage 1 (--rebuild_cache)")
    return family.pipeline_named(manifest.fingerprint.get("pipeline", family.pipeline.__name__)), frozenset(recorded)


def cached_models(path: str, family: FamilySpec) -> dict:
    """slot -> a DetectedComponent of each model stage 1 recorded in the cache's manifest (its class, config and
    files), for the family's `check_models`; a message names it as the cache's."""
    from ..cache import CacheManifest
    from ..models.detect import DetectedComponent

    out = {}
    for slot, record in CacheManifest.load(path).models.items():
        spec = next((c for c in family.components if c.class_name == record.get("class")
                     and slot in (c.name, *c.extra_slots)), None)
        if spec is None or not isinstance(record.get("config"), dict):
            continue
        files = [str(f) for f in record.get("files") or ["?"]]
        where = files[0] if len(files) == 1 else f"{files[0]} (+{len(files) - 1} more)"
        out[slot] = DetectedComponent(slot, spec, dict(record["config"]),
                                      [f"{where}, whose values the cache at {path} holds"], "the cache's manifest")
    return out


def compute_split(pipeline: type, features, config: RunConfig, task: TaskSpec) -> Split:
    """The stage-1 / stage-2 split of the run's units (its features' only) for its trainable models and loss."""
    from .losses import all_losses

    pipe = pipeline()
    pipe.activate(features)
    used = {*pipe.loss_models, *(m for u in pipe.units for m in u.models)}
    for slot in config.trainable:
        if slot not in used:  # e.g. a second DiT the loss never runs (Ideogram-4's unconditional one)
            flag = "--lora_base_model" if slot == config.lora_base_model else "--trainable_models"
            raise UserError(f"{flag} {slot}: no part of this run's training step uses '{slot}' (the loss runs "
                            f"{', '.join(pipe.loss_models) or 'no model'}): training it would change nothing")
    loss = all_losses(pipe.spec)[task.loss]
    return split_units(pipe.units, config.trainable, pipe.loss_reads(loss.reads) + pipe.active_model_fn_inputs,
                       settings=pipe.settings, loss_models=pipe.loss_models, cfg=loss.cfg)


def stage_settings(config: RunConfig, family: FamilySpec) -> dict:
    """Run-time settings every stage passes to its units and the loss (never cached)."""
    settings = {"use_gradient_checkpointing": bool(config.use_gradient_checkpointing),
                "use_gradient_checkpointing_offload": bool(config.use_gradient_checkpointing_offload),
                "batch_size": 1}
    if family.unit_settings is not None:
        settings.update(family.unit_settings(config.family_options))
    return settings


def ensure_writable(path: str, flag: str = "--output_path") -> None:
    """Fail before any work if the output directory cannot be created or written."""
    import tempfile

    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".difftune-write-test-"):
            pass
    except OSError as err:
        raise UserError(f"{flag} {path}: cannot write there ({err.strerror or err})") from None


__all__ = ["Run", "compute_split", "data_columns", "ensure_writable", "features_of_cache", "setup", "stage_settings",
           "unread_file_columns"]
