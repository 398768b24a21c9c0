"""What every family shares: units and their runner, the base pipeline, batching, the split, the family seam.

Nothing here imports a family."""

from .batch import collate_values, split_batch
from .family import FamilySpec, TokenizerSpec, families, get_family, recognise, register_family
from .graph import Split, split_units
from .pipeline import BasePipeline
from .units import PipelineUnit, run_unit

__all__ = ["BasePipeline", "FamilySpec", "PipelineUnit", "Split", "TokenizerSpec", "collate_values", "families",
           "get_family", "recognise", "register_family", "run_unit", "split_batch", "split_units"]
