"""The peer children's torchvision shim (peer_diffsynth.py, peer_diffusers.py, in DiffSynth-Studio's venv).

On a CPU-only torch, the torchvision wheel that matches it on PyPI is a CUDA build whose `_C` does not load, and
`import torchvision` then dies registering fakes for `torchvision::nms`. Defining the two op schemas first lets its
pure-Python parts import (DiffSynth's data operators, diffusers' script, and whatever transformers or diffusers pull
in). It has to run before anything imports diffusers, transformers or difftune's families, so this module imports
torch alone, and each child calls `install()` before its first other import.
"""

from __future__ import annotations

import torch

_LIB = None  # the registration lives as long as this object


def installed() -> bool:
    """Whether torchvision's op schemas are defined (by this shim or by torchvision's own `_C`)."""
    try:
        torch.ops.torchvision.nms  # noqa: B018
    except (AttributeError, RuntimeError):
        return False
    return True


def install() -> None:
    """Define `torchvision::nms` / `qnms` on a CPU-only torch, once; a CUDA torch loads torchvision's own."""
    global _LIB
    if torch.version.cuda is not None or installed():
        return
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _LIB = lib
