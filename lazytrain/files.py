"""Files written whole or not at all, and a full disk reported as one line.

NOTE: [Full disk] A write that runs out of space surfaces as whatever the writing library makes of
ENOSPC: an `OSError`, a `SafetensorError` ("os error 28"), or torch.save's "unexpected pos"
`RuntimeError`, which has lost the errno. `is_disk_full` recognises the first two by their text;
writers that know how many bytes they need also ask the disk (`free_bytes`), which covers the
third. Either way the caller removes what it half wrote and raises `no_space`, a `ResourceError`
naming the path and the space needed.
"""

from __future__ import annotations

import errno
import os
import shutil
import uuid
from pathlib import Path

from lazytrain.errors import ResourceError
from lazytrain.units import format_size

_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_FULL_TEXTS = ("no space left on device", "os error 28", "disk quota exceeded", "os error 122")


def is_disk_full(exc: BaseException) -> bool:
    """Whether `exc` (or an exception it was raised from) reports a full disk or quota."""
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in _FULL_ERRNOS:
            return True
        if any(text in str(exc).lower() for text in _FULL_TEXTS):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def free_bytes(path: str | Path) -> int | None:
    """Bytes free to this user on the disk holding `path` (or its nearest existing parent)."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    try:
        return shutil.disk_usage(path).free
    except OSError:
        return None


def no_space(path: str | Path, needed: int, fix: str = "") -> ResourceError:
    free = free_bytes(path)
    has = f", {format_size(free)} free" if free is not None else ""
    return ResourceError(
        f"no space left on the disk to write {path}: it needs about {format_size(needed, round_up=True)}{has}; "
        f"free space on that disk{fix or ', or write elsewhere'}")


def write_atomic(path: str | Path, data: str | bytes, fix: str = "") -> None:
    """Write `data` to `path` whole or not at all: a temp file beside it, fsynced, then renamed over
    it. On failure the temp file is removed and `path` is untouched; a full disk raises `no_space`."""
    path = Path(path)
    raw = data.encode("utf-8") if isinstance(data, str) else data
    tmp = path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex}")
    try:
        with open(tmp, "wb") as f:
            f.write(raw)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as exc:
        tmp.unlink(missing_ok=True)
        if isinstance(exc, Exception) and is_disk_full(exc):
            raise no_space(path, len(raw), fix) from None
        raise
    fsync_dir(path.parent)


def fsync_dir(path: Path) -> None:
    """Persist a directory's entries (a rename is durable only once its directory is synced)."""
    try:
        fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # platforms that cannot open directories (Windows) have no dir fsync
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
