"""The host's CPU cores, without torch: a launcher or a test session gives each process its share
through OMP_NUM_THREADS before torch starts there (OpenMP reads it once, as torch loads)."""

from __future__ import annotations

import os


def host_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1
