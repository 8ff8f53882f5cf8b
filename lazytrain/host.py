"""The host's CPU cores and memory, without torch: a launcher or a test session gives each process its
share of the cores through OMP_NUM_THREADS before torch starts there (OpenMP reads it once, as torch
loads); binding a schedule checks its host memory (NOTE: [Room on the host] in runtime/capacity.py)."""

from __future__ import annotations

import os
from pathlib import Path

# the memory limit of this process's control group, cgroup v2 then v1 (a container's limit)
CGROUP_LIMITS = ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes")


def host_cores() -> int:
    """The CPU cores this process may run on."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def host_memory() -> int | None:
    """The host memory this process may use: the machine's, or its control group's limit where that is
    less (a container's); None where neither is known."""
    sizes = []
    try:
        sizes.append(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))
    except (ValueError, OSError, AttributeError):  # no sysconf names for them here
        pass
    for path in CGROUP_LIMITS:
        try:
            text = Path(path).read_text().strip()
        except OSError:
            continue
        if text.isdigit():  # "max": no limit
            sizes.append(int(text))
        break
    return min(sizes) if sizes else None
