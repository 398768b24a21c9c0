"""Test support: tiny, randomly initialised models in the official on-disk layouts, and the tools the tests use.

No weights can be downloaded where difftune is tested, so every test builds a tiny model with the real
architecture (diffusers / transformers classes) and saves it exactly as the official hub repository is laid
out: sharded safetensors with their index, `config.json` beside the weights, `tokenizer/`, `scheduler/` and
`model_index.json`. Everything is deterministic across processes (fixed seeds, hand-built tokenizer
vocabularies), so two processes writing the same repository get bit-identical files.

None of it is installed with difftune: it lives beside the tests (`tests/` is on `sys.path` under pytest; the
benchmarks add it, benchmarks/common.py). What every family shares is here (the offline hub, example data sets,
clips, tokenizers, the reference's scripts, the contract suite's registry); each family's writers live in
`support.<family name>` and are reachable from here by name (`support.write_tiny_qwen_image`). The one tiny model
the product itself writes (`difftune example-workspace`) is the Qwen-Image family's `tiny` module, which
`support.qwen_image` builds on.
"""

from __future__ import annotations


from .common import *  # noqa: F401,F403
from .scripts import *  # noqa: F401,F403
from .tokenizers import *  # noqa: F401,F403
from .video import *  # noqa: F401,F403


def family_support_modules() -> list:
    """Every registered family's test-support package (importing one registers its tiny models)."""
    from .common import family_support_module
    from difftune.core.family import families

    found = [family_support_module(spec) for spec in families().values()]
    return [m for m in found if m is not None]


def __getattr__(name: str):
    if name.startswith("__"):
        raise AttributeError(name)
    for module in family_support_modules():
        if hasattr(module, name):
            return getattr(module, name)
    raise AttributeError(f"module 'support' has no attribute '{name}' (nor has any family's support package)")


def __dir__():
    return sorted(set(globals()) | {n for m in family_support_modules() for n in dir(m) if not n.startswith("_")})


