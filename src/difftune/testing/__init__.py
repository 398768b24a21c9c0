"""Tiny, randomly initialised model repositories in the official on-disk layouts.

No weights can be downloaded where difftune is tested, so every test builds a tiny model with the
real architecture (diffusers / transformers classes) and saves it exactly as the official hub
repository is laid out: sharded safetensors with their index, `config.json` beside the weights,
`tokenizer/`, `scheduler/` and `model_index.json`. Everything is deterministic across processes
(fixed seeds, a hand-built tokenizer vocabulary), so two processes writing the same repository get
bit-identical files.
"""

from __future__ import annotations

from .common import *  # noqa: F401,F403
from .common import _quiet_hf  # noqa: F401
from .qwen_image import *  # noqa: F401,F403
from .flux import *  # noqa: F401,F403
from .flux import _ldm_vae_from_diffusers  # noqa: F401
from .scripts import *  # noqa: F401,F403
from .qwen_image_scripts import write_qwen_image_script_workspace  # noqa: F401
from .video import *  # noqa: F401,F403
