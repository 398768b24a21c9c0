"""difftune: fine-tune diffusion models with LoRA or full training, with two-stage split training."""

__version__ = "0.1.0"
