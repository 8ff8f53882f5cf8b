"""Sustained direct I/O through the offload file (NOTE: [Offload files] in runtime/disk.py): 24 regions of
256 MiB written, then read back, each timed; then pairs written at once, as a host step writes a block's two
moments. `PYTHONPATH=. python bench/disk_rates.py [DIR]` on the GPU machine (default /tmp)."""

from __future__ import annotations

import statistics
import sys
import time

import torch

from lazytrain.runtime.disk import OffloadFile, aligned_empty

SIZE, COUNT = 256 << 20, 24


def _rate(nbytes: int, futures) -> float:
    start = time.perf_counter()
    for f in futures():
        f.result()
    return nbytes / (time.perf_counter() - start) / 1e9


def main(directory: str) -> None:
    buf = aligned_empty(SIZE, pin=torch.cuda.is_available())
    buf.random_(0, 255)
    with OffloadFile(directory, {f"r{i}": SIZE for i in range(COUNT)}) as f:
        write = [_rate(SIZE, lambda i=i: [f.write(f"r{i}", buf)]) for i in range(COUNT)]
        read = [_rate(SIZE, lambda i=i: [f.read(f"r{i}", buf)]) for i in range(COUNT)]
        pairs = [_rate(2 * SIZE, lambda i=i: [f.write(f"r{i}", buf), f.write(f"r{i + 1}", buf)])
                 for i in range(0, COUNT, 2)]
    print("write GB/s:", " ".join(f"{x:.2f}" for x in write))
    print("read  GB/s:", " ".join(f"{x:.2f}" for x in read))
    print("pairs GB/s:", " ".join(f"{x:.2f}" for x in pairs))
    print(f"median write {statistics.median(write):.2f} read {statistics.median(read):.2f} "
          f"pairs {statistics.median(pairs):.2f} GB/s")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp")
