"""A host optimizer step on a worker thread while the main thread runs Python, per GIL switch interval.

The runtime steps host-stepped blocks on a worker thread while the main thread replays the
schedule, mostly in Python. Each of a host step's torch calls needs the GIL back after its kernel;
this times the runtime's own host step (`staged_optimizer`, fp32 and bf16 masters, 32-bit states)
for a Qwen2.5-7B and a Qwen2.5-1.5B decoder layer with the main thread idle, then busy in Python at
several switch intervals (NOTE: [Host steps and the GIL] in lazytrain/runtime/streams.py):

    python bench/host_gil.py            # both layers
    python bench/host_gil.py --small    # the 1.5B layer only

Medians of 4 timed steps after one.
"""

import argparse
import os
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.host_step import layer_shapes  # noqa: E402
from lazytrain.runtime.optim import staged_optimizer  # noqa: E402

LAYERS = {"7B": (3584, 18944, 512), "1.5B": (1536, 8960, 256)}
LOADS = (("idle", 5e-3), ("python", 5e-3), ("python", 1e-3), ("python", 2e-4))


def host_step(hidden: int, intermediate: int, kv: int, bf16: bool):
    params = [torch.nn.Parameter(torch.randn(s) * 0.02) for s in layer_shapes(hidden, intermediate, kv)]
    if bf16:
        params = [torch.nn.Parameter(p.detach().bfloat16()) for p in params]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    opt = staged_optimizer("32bit", [{"params": params, "fused": True, "states": "32bit"}], lr=1e-5)
    return lambda: opt.step_group(0)


def timed_beside(step, busy: bool, steps: int = 5) -> float:
    """The median time of `step` on a worker thread, the main thread in a Python loop if `busy`."""
    times, stop = [], threading.Event()

    def worker():
        for _ in range(steps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        stop.set()
    w = threading.Thread(target=worker)
    w.start()
    while busy and not stop.is_set():
        total = 0
        for i in range(1000):
            total += i
    w.join()
    return statistics.median(times[1:])


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--small", action="store_true", help="the 1.5B layer only")
    args = p.parse_args()
    torch.set_num_threads(len(os.sched_getaffinity(0)))  # as the runtime's host worker (NOTE: [Host step threads])
    default = sys.getswitchinterval()
    rows = []
    for layer, shape in LAYERS.items():
        if args.small and layer != "1.5B":
            continue
        for master, bf16 in (("fp32", False), ("bf16", True)):
            step = host_step(*shape, bf16)
            step()
            for load, interval in LOADS:
                sys.setswitchinterval(interval)
                try:
                    rows.append((f"{layer} {master}", load, interval, timed_beside(step, load == "python")))
                finally:
                    sys.setswitchinterval(default)
    print(f"{torch.get_num_threads()} threads")
    print(f"{'layer, master':<15}{'main thread':<13}{'switch ms':>10}{'median s':>10}")
    for name, load, interval, t in rows:
        print(f"{name:<15}{load:<13}{interval * 1e3:>10.1f}{t:>10.3f}")


if __name__ == "__main__":
    main()
