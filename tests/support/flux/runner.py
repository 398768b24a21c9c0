"""Running one unit outside a pipeline class (the variants' units before they are wired into FluxImagePipeline)."""

from __future__ import annotations

import dataclasses

import torch


class UnitPipe:
    """What units read of a pipeline: models by slot, device, dtype, the two tokenizers (`tokenizer`, `tokenizer_2`
    among the keyword arguments), and any other attribute given (`face_embedder`)."""

    def __init__(self, tokenizer=None, tokenizer_2=None, face_embedder=None, **models):
        self.tokenizer_1, self.tokenizer_2, self.face_embedder = tokenizer, tokenizer_2, face_embedder
        self.models = models
        self.model_names = tuple(models)
        self.device = torch.device("cpu")
        self.torch_dtype = torch.float32

    def __getattr__(self, name):
        models = self.__dict__.get("models", {})
        if name in models:
            return models[name]
        raise AttributeError(name)


def run_unit_on(unit, models: dict, cfg: bool = False, **values) -> dict:
    """`unit` run by difftune's runner (declarations enforced) on `values`, with `models` as the pipeline's."""
    from difftune.core.units import run_unit

    return run_unit(UnitPipe(**models), unit, dict(values), cfg=cfg)


def with_config(spec, config: dict, label: str = "tiny"):
    """`spec` with one more known config (tiny models have no release's sizes)."""
    return dataclasses.replace(spec, known_configs={**spec.known_configs, label: config})
