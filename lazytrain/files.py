"""Files and directories written whole or not at all, places probed for writing before a long job
writes there, and a full disk reported as one line.

NOTE: [Full disk] A write that runs out of space surfaces as whatever the writing library makes of
ENOSPC: an `OSError`, a `SafetensorError` ("os error 28"), or torch.save's "unexpected pos"
`RuntimeError`, which has lost the errno. `is_disk_full` recognises the first two by their text;
writers that know how many bytes they need also ask the disk (`free_bytes`), which covers the
third. Either way the caller removes what it half wrote and raises `no_space`, a `ResourceError`
naming the path and the space needed.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import re
import shutil
import sys
import tempfile
import uuid
from pathlib import Path

from lazytrain.errors import ResourceError
from lazytrain.units import format_size

_FULL_ERRNOS = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}
_FULL_TEXTS = ("no space left on device", "os error 28", "disk quota exceeded", "os error 122")


def caching() -> bool:
    """Whether lazytrain's on-disk caches (plans, compiled stage bodies) are used: not under
    `LAZYTRAIN_NO_CACHE=1`."""
    return os.environ.get("LAZYTRAIN_NO_CACHE", "") in ("", "0")


def cache_dir(name: str) -> Path:
    """`$XDG_CACHE_HOME/lazytrain/NAME` (else `~/.cache/lazytrain/NAME`)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "lazytrain" / name


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


def nearest_existing(path: str | Path) -> Path:
    """`path` where it exists, else its nearest existing parent."""
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | Path) -> int | None:
    """Bytes free to this user on the disk holding `path` (or its nearest existing parent)."""
    try:
        return shutil.disk_usage(nearest_existing(path)).free
    except OSError:
        return None


def cannot_write(directory: str | Path) -> OSError | None:
    """The error that stops making an entry in `directory`, else None: a probe directory is made
    and removed there. os.access is not enough: it lets root write under /proc, where nothing can
    be made."""
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".lazytrain-probe-", dir=directory))
    except OSError as exc:
        return exc
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


# NOTE: [Directories replaced whole]
# An output directory (an export) is written in a temp directory beside it, `DIR.tmp-<hex>` (the
# same filesystem), fsynced, and swapped with `DIR` in one atomic rename (Linux's renameat2
# RENAME_EXCHANGE); the old one, now under the temp name, is removed after. A kill at any moment
# leaves `DIR` whole, old or new, plus at most one temp directory, which the next write of `DIR`
# removes. Where the system cannot swap, the old one is renamed aside first: a kill between the
# two renames leaves both whole under temp names and no `DIR`.

_AT_FDCWD, _RENAME_EXCHANGE = -100, 2


def _temp_beside(dest: Path) -> Path:
    return dest.with_name(f"{dest.name}.tmp-{uuid.uuid4().hex}")


def remove_leftovers(dest: Path) -> None:
    """Temp directories of earlier writes of `dest` that a kill left beside it."""
    if not dest.parent.is_dir():
        return
    leftover = re.compile(re.escape(dest.name) + r"\.tmp-[0-9a-f]{32}")
    for entry in dest.parent.iterdir():
        if leftover.fullmatch(entry.name) and entry.is_dir() and not entry.is_symlink():
            shutil.rmtree(entry, ignore_errors=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap two existing paths in one atomic step; False where this system or filesystem cannot."""
    rename = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None) if sys.platform == "linux" else None
    if rename is None:
        return False
    if rename(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE) == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EXDEV):
        return False
    raise OSError(err, os.strerror(err), str(b))


def fsync_tree(path: Path) -> None:
    """Persist every file under `path`, then its directories' entries."""
    for top, _, names in os.walk(path):
        for name in names:
            fd = os.open(os.path.join(top, name), os.O_RDONLY)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
        fsync_dir(Path(top))


@contextlib.contextmanager
def replaced_whole(dest: str | Path):
    """Yield a temp directory beside `dest` to write into; when the block ends, its files are
    fsynced and it replaces `dest` whole (NOTE: [Directories replaced whole]). If the block raises,
    the temp directory is removed and `dest` is untouched. A link to a directory is kept: its
    target is replaced."""
    dest = Path(dest)
    dest = Path(os.path.realpath(dest)) if dest.is_symlink() else dest.absolute()
    remove_leftovers(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_beside(dest)
    tmp.mkdir()
    try:
        yield tmp
        fsync_tree(tmp)
        old = _swap_in(tmp, dest)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    fsync_dir(dest.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def _swap_in(tmp: Path, dest: Path) -> Path | None:
    """`tmp` renamed to `dest`; returns where the old `dest` now is (None where there was none)."""
    if not dest.exists() or (dest.is_dir() and not any(dest.iterdir())):
        os.replace(tmp, dest)  # onto nothing, or an empty directory: one rename
        return None
    if _exchange(tmp, dest):
        return tmp
    aside = _temp_beside(dest)
    os.replace(dest, aside)
    try:
        os.replace(tmp, dest)
    except BaseException:
        os.replace(aside, dest)
        raise
    return aside
