"""Sustained direct I/O through the offload file (NOTE: [Sustained disk rates] in lazytrain/profile.py):
24 regions of 256 MiB written, then read back, each timed, as `lazytrain profile` measures the disk.
`PYTHONPATH=. python bench/disk_rates.py [DIR]` on the GPU machine (default /tmp)."""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

from lazytrain.profile import disk_region_rates


def main(directory: str) -> None:
    write, read, direct = disk_region_rates(Path(directory), 256 << 20, 24)
    print("write GB/s:", " ".join(f"{x / 1e9:.2f}" for x in write))
    print("read  GB/s:", " ".join(f"{x / 1e9:.2f}" for x in read))
    print(f"median write {statistics.median(write) / 1e9:.2f} read {statistics.median(read) / 1e9:.2f} GB/s"
          f"{'' if direct else ' (through the page cache: upper bounds)'}")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp")
