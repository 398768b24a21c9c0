"""Atomic file writing shared by everything difftune saves.

A file is written under a temporary name in the same folder and renamed, so a reader (or a resumed run)
sees the old file or the whole new one, never a part. safetensors creates files with mode 0600; the final
file gets the usual permissions (0666 minus the umask) so others on a shared machine can read checkpoints.
A write that fails for want of room (disk full, quota, file-size limit) or any other OS error is one
`UserError` line naming the file and the bytes it needed; the earlier file stays and no temp file is left.
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

from .errors import UserError

if TYPE_CHECKING:
    import torch

_REASONS = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded",
            errno.EFBIG: "file too large (over the file-size limit, ulimit -f)"}


def os_error_of(exc: BaseException) -> OSError | None:
    """`exc` as an OSError: itself, or the OS error a library reported in its own exception type
    (safetensors says "... (os error 28)"); None if it is not one."""
    if isinstance(exc, OSError):
        return exc
    found = re.search(r"os error (\d+)", str(exc))
    if found:
        code = int(found.group(1))
        return OSError(code, os.strerror(code))
    return None


def _size(nbytes: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if nbytes >= scale:
            return f"{nbytes / scale:.1f} {unit} ({nbytes} bytes)"
    return f"{nbytes} bytes"


def write_error(path: str | os.PathLike, err: OSError, nbytes: int | None = None) -> UserError:
    """The one line for a failed write of `path` (`nbytes`: the size of what was being written)."""
    reason = _REASONS.get(err.errno) or (err.strerror or str(err)).strip().rstrip(".").lower()
    needed = f" while writing {_size(nbytes)}" if nbytes is not None else ""
    return UserError(f"cannot write {path}: {reason}{needed}; the previous file, if any, is unchanged")


def normal_permissions(path: str | os.PathLike) -> None:
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename durable (best effort: not every OS/file system allows fsync on a directory)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def atomic_write(path: str | os.PathLike, write: Callable[[Path], None], nbytes: int | None = None,
                 durable: bool = False) -> Path:
    """`write(tmp)` into a temporary file beside `path`, then rename it over `path` (normal permissions).
    `durable`: fsync the file before the rename and the folder after it (a commit point that survives a power
    cut, as the cache's shards need). An OS error (disk full, ...) is a UserError naming `path` and `nbytes`,
    the size being written."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")  # the cache recognises ".tmp-" as a temp file
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(tmp)
        normal_permissions(tmp)
        if durable:
            with open(tmp, "rb+") as f:
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if durable:
            fsync_dir(path.parent)
    except Exception as exc:
        err = os_error_of(exc)
        if err is None:
            raise
        raise write_error(path, err, nbytes) from None
    finally:
        tmp.unlink(missing_ok=True)
    return path


def atomic_save_safetensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike,
                            metadata: Mapping[str, str] | None = None) -> Path:
    from safetensors.torch import save_file

    nbytes = sum(t.numel() * t.element_size() for t in tensors.values())  # the data; the header adds a little
    return atomic_write(path, lambda tmp: save_file(
        {k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(tmp),
        metadata=dict(metadata) if metadata else None), nbytes)


def atomic_write_text(path: str | os.PathLike, text: str) -> Path:
    data = text.encode()
    return atomic_write(path, lambda tmp: tmp.write_bytes(data), len(data))


def atomic_save_image(image, path: str | os.PathLike) -> Path:
    """A PIL image, in the format its final name's extension says (PNG if none)."""
    from PIL import Image

    fmt = Image.registered_extensions().get(Path(path).suffix.lower(), "PNG")
    return atomic_write(path, lambda tmp: image.save(tmp, format=fmt))
