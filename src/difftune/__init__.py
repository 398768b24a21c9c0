"""difftune: fine-tune diffusion models with LoRA or full training, with two-stage split training.

The Python API (`difftune.api`, docs/api.md) is re-exported here lazily, so `import difftune` stays cheap
for the command line: `from difftune import DiffusionTrainingModule, launch_training_task, ...`.
"""

__version__ = "0.1.0"

_API = (
    "BasePipeline", "ComponentSpec", "DiffusionTrainingModule", "FamilySpec", "FlowMatchScheduler", "ModelConfig",
    "ModelLogger", "PipelineUnit", "QwenImagePipeline", "Split", "TokenizerSpec", "UnifiedDataset", "UserError",
    "detect_component", "direct_distill_loss", "gradient_checkpoint_forward", "images_to_tensor", "launch_training_task",
    "load_component", "register_family", "sample_generator", "sft_loss", "split_units",
    "read_video", "save_video",  # clips as lists of PIL frames (difftune.media.video)
)


def __getattr__(name: str):
    if name in _API:
        from . import api

        return getattr(api, name)
    raise AttributeError(f"module 'difftune' has no attribute '{name}'")


def __dir__():
    return sorted(list(globals()) + list(_API))


__all__ = ["__version__", *_API]
