"""Atomic file writing shared by everything difftune saves.

A file is written under a temporary name in the same folder and renamed, so a reader (or a resumed run)
sees the old file or the whole new one, never a part. safetensors creates files with mode 0600; the final
file gets the usual permissions (0666 minus the umask) so others on a shared machine can read checkpoints.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import torch


def normal_permissions(path: str | os.PathLike) -> None:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def atomic_save_safetensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike,
                            metadata: Mapping[str, str] | None = None) -> Path:
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp),
                  metadata=dict(metadata) if metadata else None)
        normal_permissions(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path
