"""Model families: each is a pipeline class (units + model_fn) registered by name."""

from .base import BasePipeline, PipelineUnit, collate_values, run_unit, split_batch
from .graph import Split, split_units


def families() -> dict[str, type]:
    from .qwen_image import QwenImagePipeline

    return {"qwen_image": QwenImagePipeline}


__all__ = ["BasePipeline", "PipelineUnit", "Split", "collate_values", "families", "run_unit", "split_batch",
           "split_units"]
