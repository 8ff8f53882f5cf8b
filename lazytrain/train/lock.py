"""One run at a time in a run directory.

NOTE: [Run lock]
Two processes training into one `--checkpoint-dir` interleave their log records and race for the
checkpoint names, and a `--resume` beside a running run rewrites the log under it (a review lost
steps 26 to 40 that way). So a run holds an exclusive `fcntl.flock` on `RUN/.lock` from its first
look at the directory to its exit, and a second run is refused naming the process that holds it.
The lock is the open file's, not the file's existence: the kernel drops it when the holder exits,
a kill -9 included, so a stale `.lock` never blocks the next run. The file holds the holder's
process id, host and command line, for the refusal's text. On several ranks rank 0 holds it.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path

from lazytrain.errors import CheckpointError

LOCK_FILE = ".lock"


class RunLock:
    """An exclusive lock on a run directory, held until `release()` or the process's exit."""

    def __init__(self, run_dir: Path, fd: int):
        self.run_dir = run_dir
        self._fd: int | None = fd

    @classmethod
    def take(cls, run_dir: Path) -> "RunLock":
        """Lock `run_dir` (which must exist), or raise `CheckpointError` naming the holder."""
        path = run_dir / LOCK_FILE
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise CheckpointError(f"--checkpoint-dir {run_dir} cannot hold its lock file ({exc.strerror}); pass a "
                                  "directory you can write") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _holder(fd)
            os.close(fd)
            raise CheckpointError(f"{run_dir} is in use by another lazytrain run ({holder}); wait for it to end, or "
                                  "pass another --checkpoint-dir") from None
        record = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S"),
                  "argv": sys.argv}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(record) + "\n").encode(), 0)
        return cls(run_dir, fd)

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the file drops the lock
            self._fd = None


def _holder(fd: int) -> str:
    """Who holds the lock, from what it wrote (it may not have written yet)."""
    try:
        record = json.loads(os.pread(fd, 1 << 16, 0).decode() or "{}")
        return f"process {int(record['pid'])} on {record['host']}, since {record['since']}"
    except (OSError, ValueError, KeyError, TypeError):
        return "a process that has not said which yet"
