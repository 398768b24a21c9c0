"""The one pipeline builder: a family's pipeline with the models a stage uses and the tokenizers / processors they
need. `BasePipeline.from_pretrained`, `difftune train` (each stage), `difftune sample` and validation all build
through it, so the rules for finding a tokenizer are written once.

Where a tokenizer is found, first hit wins: the caller's source for it (a `<attr>_config` of from_pretrained, or
the family option that names it, e.g. --tokenizer_path, as a folder or `model_id:folder/`); the folder beside its
model's weights (official layout; for a hub id, that folder of the same repository); the family's `default`.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import UserError, one_line
from .features import RunContext


def recognised(spec, configs: Sequence) -> list[tuple[str, Any, Any]]:
    """(slot, ModelConfig, DetectedComponent) for bare model configs, recognised among the family's components."""
    from ..models.detect import as_model_config, detect_components

    detected = [(det, c) for c in map(as_model_config, configs) for det in detect_components(c, spec.components)]
    return [(slot, c, det) for (slot, c), (det, _) in zip(spec.assign_slots(detected), detected)]


def context_of(models: Iterable, columns: Iterable[str] = (), options=None) -> RunContext:
    """A run's context from its recognised models ((slot, config, detected) triples) and data columns."""
    return RunContext(columns=frozenset(columns), models={slot: dict(det.config) for slot, _, det in models},
                      options=options)


def build_pipeline(spec, models: Sequence, *, device="cpu", torch_dtype=torch.float32, wanted: set[str] | None = None,
                   features: Iterable[str] | None = None, pipeline: type | None = None,
                   tokenizers: Mapping[str, Any] | None = None, options=None, load_device=None, scheduler=None,
                   detected: Mapping[str, Any] | None = None, log=print):
    """The pipeline of `spec` with the models of `models` whose slot is in `wanted` (None: all) and their
    tokenizers.

    `models`: (slot, ModelConfig) pairs as the train command resolved them, or bare model configs (recognised
    here). `pipeline`: the class (default: the variant the weights claim, else the family's). `features`: the
    run's features (None: each call resolves its own). `tokenizers`: attr -> a source given by the caller.
    `options`: the family's options (their tokenizer flags are sources too). `detected`: slot -> its
    DetectedComponent where the caller recognised the models already."""
    from ..models import load_component
    from ..util import torch_dtype as as_dtype

    if models and not isinstance(models[0], tuple):
        triples = recognised(spec, models)
        pairs = [(slot, config) for slot, config, _ in triples]
        detected = {slot: det for slot, _, det in triples}
    else:
        pairs, detected = list(models), dict(detected or {})
    if pairs and not detected:  # each slot's own recognition (a file may hold two models: a companion)
        by_config: dict = {}
        for slot, config in pairs:
            by_config.setdefault(id(config), (config, []))[1].append(slot)
        for config, slots in by_config.values():
            found = _detect(spec, config)
            for slot in slots:
                detected[slot] = next((d for d in found if slot in (d.name, *d.spec.extra_slots)), found[0])
    if pipeline is None:
        pipeline = spec.pipeline_for(RunContext(models={s: dict(d.config) for s, d in detected.items()},
                                                options=options))
    pipeline.check_models(detected)  # the parts fit each other, before anything is loaded
    dtype = as_dtype(torch_dtype) if not isinstance(torch_dtype, torch.dtype) else torch_dtype
    pipe = pipeline(device=device, torch_dtype=dtype, **({"scheduler": scheduler} if scheduler is not None else {}))
    for slot, config in pairs:
        if wanted is not None and slot not in wanted:
            log(f"not loading {slot} ({config.describe()}): this stage does not use it")
            continue
        if slot not in pipe.model_names:
            raise UserError(f"{config.describe()} is a {slot}, which {pipeline.__name__} does not take")
        loaded = load_component(config, spec.components, torch_dtype=dtype, device=load_device or device,
                                detected=detected.get(slot), log=log)
        setattr(pipe, slot, loaded.module)
    if features is not None:
        pipe.activate(features)
    _load_tokenizers(pipe, spec, pairs, features, dict(tokenizers or {}), options)
    return pipe


def _detect(spec, config) -> list:
    from ..models.detect import detect_components

    return detect_components(config, spec.components)


def _load_tokenizers(pipe, spec, models, features, given: dict, options) -> None:
    for tok in spec.tokenizers:
        if pipe.models.get(tok.slot) is None:
            continue
        needed = tok.download and (tok.feature is None or (features is not None and tok.feature in features))
        source = given.get(tok.attr)
        if source is None and tok.flag and options is not None:
            source = getattr(options, tok.flag, None)
        if isinstance(source, str) and not os.path.exists(source) and ":" in source:
            source = hub_folder(source)  # model_id:folder/, as the reference's flags take
        origin = "given" if tok.attr in given else f"--{tok.flag}"
        where = source if source is not None else _beside(models, tok, download=needed)
        if source is None and where is not None:
            origin = f"found beside the {tok.slot}"
        if where is None and needed and tok.default:
            where = hub_folder(tok.default)
            origin = (f"the family's default: no --{tok.flag} given and no {tok.folder or tok.slot}/ beside the "
                      f"{tok.slot}" if tok.flag else "the family's default")
        if where is None:
            if tok.required and (tok.feature is None or (features is not None and tok.feature in features)):
                flag = f"pass --{tok.flag} " if tok.flag else ""
                raise UserError(f"no {tok.attr} found: {flag}(looked for a {tok.folder}/ folder beside the "
                                f"{tok.slot} weights)")
            continue
        loaded = tok.load(where)
        _check_fits(pipe, tok, loaded, where, origin)
        setattr(pipe, tok.attr, loaded)


# a prompt any text tokenizer turns into tokens
_PROBE = "a photo of a cat"


def _check_fits(pipe, tok, loaded, where, origin: str) -> None:
    """A tokenizer that does not fit the model it serves is refused (it loaded and trained on nonsense before): more
    tokens than the encoder's embedding has rows, a non-empty prompt encoded to no tokens (a folder without
    tokenizer.json), or what the family knows its encoder needs (`TokenizerSpec.fits`)."""
    from transformers import PreTrainedTokenizerBase

    if not isinstance(loaded, PreTrainedTokenizerBase):
        return
    encoder = pipe.models.get(tok.slot)
    name = where.describe() if hasattr(where, "describe") else str(where)
    problem = None
    try:
        ids = loaded(_PROBE, add_special_tokens=False)["input_ids"]
    except Exception as e:  # a tokenizer that cannot encode a plain prompt is as broken as one that encodes none
        problem = f"it cannot encode a prompt ({one_line(e)})"
        ids = None
    if problem is None and not [i for i in ids if i != loaded.unk_token_id]:
        problem = (f"it encodes the prompt {_PROBE!r} to no tokens ({len(loaded)} tokens in its vocabulary; is its "
                   f"tokenizer.json missing?)")
    embeddings = getattr(encoder, "get_input_embeddings", lambda: None)()
    rows = getattr(embeddings, "num_embeddings", None)
    if problem is None and rows is not None and len(loaded) > rows:
        problem = (f"it has {len(loaded)} tokens and the {tok.slot}'s embedding {rows} rows: it is another "
                   f"model's tokenizer")
    if problem is None and tok.fits is not None and encoder is not None:
        problem = tok.fits(loaded, encoder)
    if problem:
        fix = f"; pass --{tok.flag} with the {tok.slot}'s own tokenizer" if tok.flag else ""
        raise UserError(f"{tok.attr} {name} ({origin}) does not fit the {tok.slot}: {problem}{fix}")


def hub_folder(location: str):
    """`model_id:folder/` -> the ModelConfig of that folder of a hub repository."""
    from ..models import ModelConfig

    model_id, _, folder = location.partition(":")
    return ModelConfig(model_id=model_id, origin_file_pattern=folder)


def _beside(models, tok, download: bool):
    """The official layout keeps tokenizer/ (and processor/) beside the model's folder; for a hub id, the same
    repository's folder (downloaded like the weights, if `download` and the family names no other place for it).
    `TokenizerSpec.folder` "" is the weights' own folder (Qwen2.5-VL-7B-Instruct keeps its processor there)."""
    from ..models import ModelConfig

    for slot, config in models:
        if slot != tok.slot:
            continue
        if getattr(config, "model_id", None) and download and tok.default is None and tok.folder:
            return ModelConfig(model_id=config.model_id, origin_file_pattern=f"{tok.folder}/",
                               local_model_path=config.local_model_path, download_source=config.download_source,
                               skip_download=config.skip_download)
        files = config.resolve()
        first = Path(files[0] if isinstance(files, (list, tuple)) else files)
        folder = first if first.is_dir() else first.parent
        # folder "": the weights' own folder (a repository whose processor files sit beside its weights)
        candidate = folder.parent / tok.folder if tok.folder else folder
        if tok.else_folder and not (candidate / "tokenizer_config.json").is_file():
            candidate = folder.parent / tok.else_folder
        if candidate.is_dir():
            return str(candidate)
    return None


__all__ = ["build_pipeline", "context_of", "hub_folder", "recognised"]
