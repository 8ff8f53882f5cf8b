"""Which I/O engine the disk tier should use, measured: sustained direct reads and writes of
page-locked host memory through the offload file (runtime/disk.py: O_DIRECT pread/pwrite on a
thread pool) at several thread counts and chunk sizes, against kvikio's `CuFile` (its POSIX thread
pool; GPUDirect Storage where the machine has it), each alone and with reads and writes at once.

`PYTHONPATH=. python bench/disk_engines.py [DIR] [GIB]` on the GPU machine. Every pass moves GIB
(default 6) of distinct 256 MiB regions; the rate of a pass is its bytes over its wall time
(all regions in flight at once, as the tier submits a stage's tensors). The median of 3 passes
after one warm-up pass is printed per engine, as a table last.
"""

from __future__ import annotations

import os
import statistics
import sys
import time
from pathlib import Path

import torch

from lazytrain.runtime.disk import OffloadFile, aligned_empty

REGION = 256 << 20


def _passes(run, repeats: int = 3) -> float:
    run()  # warm-up: first touch of the file's blocks
    rates = [run() for _ in range(repeats)]
    return statistics.median(rates)


def offload_file(directory: Path, total: int, threads: int, chunk: int) -> dict[str, float]:
    n = total // REGION
    bufs = [aligned_empty(REGION, pin=torch.cuda.is_available()).fill_(i % 251) for i in range(n)]
    out = {}
    with OffloadFile(directory, {f"r{i}": REGION for i in range(2 * n)}, threads=threads, chunk_bytes=chunk) as f:
        def timed(ops) -> float:
            start = time.perf_counter()
            futures = [op() for op in ops]
            for fut in futures:
                fut.result()
            return sum(REGION for _ in ops) / (time.perf_counter() - start)
        out["write"] = _passes(lambda: timed([lambda i=i: f.write(f"r{i}", bufs[i]) for i in range(n)]))
        out["read"] = _passes(lambda: timed([lambda i=i: f.read(f"r{i}", bufs[i]) for i in range(n)]))
        half = n // 2  # reads of one half's regions beside writes of the other's
        out["read+write"] = _passes(lambda: timed(
            [lambda i=i: f.read(f"r{i}", bufs[i]) for i in range(half)]
            + [lambda i=i: f.write(f"r{n + i}", bufs[half + i]) for i in range(n - half)]))
        out["direct"] = float(f.direct)
    return out


def kvikio_file(directory: Path, total: int, threads: int, task: int) -> dict[str, float]:
    import kvikio
    import kvikio.defaults
    import numpy as np

    kvikio.defaults.set({"num_threads": threads, "task_size": task})
    n = total // REGION
    bufs = [aligned_empty(REGION, pin=torch.cuda.is_available()).fill_(i % 251) for i in range(n)]
    arrays = [np.frombuffer((b.numpy()), dtype=np.uint8) for b in bufs]
    path = directory / f"kvikio-bench-{os.getpid()}.bin"
    out = {}
    try:
        with open(path, "wb") as fh:
            os.posix_fallocate(fh.fileno(), 0, 2 * n * REGION)
        with kvikio.CuFile(path, "r+") as f:
            def timed(ops) -> float:
                start = time.perf_counter()
                futures = [op() for op in ops]
                moved = sum(fut.get() for fut in futures)
                return moved / (time.perf_counter() - start)
            out["write"] = _passes(lambda: timed([lambda i=i: f.pwrite(arrays[i], REGION, i * REGION) for i in range(n)]))
            out["read"] = _passes(lambda: timed([lambda i=i: f.pread(arrays[i], REGION, i * REGION) for i in range(n)]))
            half = n // 2
            out["read+write"] = _passes(lambda: timed(
                [lambda i=i: f.pread(arrays[i], REGION, i * REGION) for i in range(half)]
                + [lambda i=i: f.pwrite(arrays[half + i], REGION, (n + i) * REGION) for i in range(n - half)]))
        out["compat"] = float(kvikio.defaults.is_compat_mode_preferred())
    finally:
        path.unlink(missing_ok=True)
    return out


def main(directory: str, gib: float) -> None:
    d, total = Path(directory), int(gib * (1 << 30)) // REGION * REGION
    rows = []
    for threads, chunk in ((4, 8 << 20), (8, 8 << 20), (16, 8 << 20), (16, 32 << 20), (32, 32 << 20), (64, 16 << 20)):
        r = offload_file(d, total, threads, chunk)
        rows.append((f"offload file, {threads} threads, {chunk >> 20} MiB", r))
        print(rows[-1], flush=True)
    try:
        for threads, task in ((4, 4 << 20), (16, 4 << 20), (16, 16 << 20), (64, 16 << 20)):
            r = kvikio_file(d, total, threads, task)
            rows.append((f"kvikio, {threads} threads, {task >> 20} MiB tasks", r))
            print(rows[-1], flush=True)
    except ImportError as exc:
        print(f"kvikio not measured: {exc}")
    print(f"\n{total / 1e9:.1f} GB a pass, median of 3 after a warm-up, GB/s, in {directory}")
    print("| engine | write | read | read+write (both together) |")
    print("|---|---|---|---|")
    for name, r in rows:
        print(f"| {name} | {r['write'] / 1e9:.2f} | {r['read'] / 1e9:.2f} | {r['read+write'] / 1e9:.2f} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else "/tmp", float(sys.argv[2]) if len(sys.argv) > 2 else 6.0)
