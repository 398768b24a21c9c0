"""Atomic file writing shared by everything difftune saves.

A file is written under a temporary name in the same folder and renamed, so a reader (or a resumed run)
sees the old file or the whole new one, never a part. safetensors creates files with mode 0600; the final
file gets the usual permissions (0666 minus the umask) so others on a shared machine can read checkpoints.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


def normal_permissions(path: str | os.PathLike) -> None:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` into a temporary file beside `path`, then rename it over `path` (normal permissions)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        write(tmp)
        normal_permissions(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def atomic_save_safetensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike,
                            metadata: Mapping[str, str] | None = None) -> Path:
    from safetensors.torch import save_file

    return atomic_write(path, lambda tmp: save_file(
        {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp),
        metadata=dict(metadata) if metadata else None))


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    return atomic_write(path, lambda tmp: tmp.write_text(text))


def atomic_save_image(image, path: str | os.PathLike) -> Path:
    """A PIL image, in the format its final name's extension says (PNG if none)."""
    from PIL import Image

    fmt = Image.registered_extensions().get(Path(path).suffix.lower(), "PNG")
    return atomic_write(path, lambda tmp: image.save(tmp, format=fmt))
