"""difftune: fine-tune diffusion models with LoRA or full training, with two-stage split training.

The Python API (`difftune.api`, docs/api.md) is re-exported here lazily, so `import difftune` stays cheap
for the command line: `from difftune import DiffusionTrainingModule, launch_training_task, ...`.
"""

from .version import __version__

_API = (
    "BasePipeline", "ComponentSpec", "DiffusionTrainingModule", "FamilySpec", "FlowMatchScheduler", "ModelConfig",
    "ModelLogger", "PipelineUnit", "Split", "TokenizerSpec", "UnifiedDataset", "UserError", "detect_component",
    "direct_distill_loss", "gradient_checkpoint_forward", "images_to_tensor", "launch_training_task",
    "load_component", "pipeline_classes", "register_family", "sample_generator", "sft_loss", "split_units",
    "read_video", "save_video",  # clips as lists of PIL frames (difftune.media.video)
)


def __getattr__(name: str):
    if name in _API or name.endswith("Pipeline"):  # every registered family's pipeline class too
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'difftune' has no attribute '{name}'")


def __dir__():
    from .api import pipeline_classes

    return sorted(list(globals()) + list(_API) + list(pipeline_classes()))


__all__ = ["__version__", *_API]
