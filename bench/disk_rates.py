"""Sustained direct I/O through the offload file (NOTE: [Sustained disk rates] in lazytrain/profile.py):
24 regions of 256 MiB written, then read back, then 12 written while 12 others are read (NOTE: [Disk
reads and writes at once] in lazytrain/hardware/__init__.py), each timed, as `lazytrain profile`
measures the disk. `PYTHONPATH=. python bench/disk_rates.py [DIR]` on the GPU machine (default /tmp)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from lazytrain.profile import disk_region_rates


def main(directory: str) -> None:
    r = disk_region_rates(Path(directory), 256 << 20, 24)
    print("write GB/s:", " ".join(f"{x / 1e9:.2f}" for x in r.write))
    print("read  GB/s:", " ".join(f"{x / 1e9:.2f}" for x in r.read))
    print("both  GB/s:", " ".join(f"{x / 1e9:.2f}" for x in r.both))
    print(f"median write {statistics.median(r.write) / 1e9:.2f} read {statistics.median(r.read) / 1e9:.2f} "
          f"both at once {statistics.median(r.both) / 1e9:.2f} GB/s"
          f"{'' if r.direct else ' (through the page cache: upper bounds)'}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp")
