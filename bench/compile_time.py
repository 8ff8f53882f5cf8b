"""Compile time against capture time, on this machine (no GPU needed).

    python bench/compile_time.py --model qwen2.5-7b --batch 32 --seq 1024 --states 8bit --master bf16 --budget 24GiB

Each repeat captures the model alone (`torch.export`, the pass `capture`, for the profile's device
as the compile does: NOTE: [Capture on the target device]), then compiles it cold
(`LAZYTRAIN_NO_CACHE=1`: no plan cache) with `--time-passes`, in the same process, so a busy machine
slows both alike; it prints compile/capture per repeat and their median, with the solver's status,
gap and the predicted step time. The first capture in a process pays torch's warm-up: a warm-up
capture runs first and is not counted.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--seq", type=int, default=1024)
    p.add_argument("--budget", default="24GiB", help="a size (e.g. 24GiB) or max")
    p.add_argument("--states", choices=["32bit", "8bit"], default="32bit")
    p.add_argument("--master", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--hardware", default="h200")
    p.add_argument("--host-memory", default=None, help="override the profile's host memory (e.g. 2TB for a 70B model)")
    p.add_argument("--disk", action="store_true", help="the plan may keep states and stage outputs on disk (--disk)")
    p.add_argument("--time-limit", type=float, default=60.0)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--tile-bytes", default=None, help="a tile size (e.g. 256MiB; 0: untiled), captured and compiled "
                   "so; default: the compile's own choice (NOTE: [Tiles where nothing else fits]), an untiled capture")
    args = p.parse_args(argv)
    os.environ["LAZYTRAIN_NO_CACHE"] = "1"

    import torch

    from bench.shapes import batch, meta_model
    from lazytrain import hardware
    from lazytrain.ir.capture import capture
    from lazytrain.kernels.tiled import tiled
    from lazytrain.options import CompileOptions
    from lazytrain.pipeline import compile_model
    from lazytrain.units import parse_size

    hw = hardware.load(args.hardware)
    if args.host_memory:
        hw = dataclasses.replace(hw, host_memory_bytes=parse_size(args.host_memory))
    meta = meta_model(args.model, args.seq).to(torch.bfloat16)
    b = batch(args.model, args.batch, args.seq)
    options = CompileOptions(budget="max" if args.budget == "max" else parse_size(args.budget), time_limit=args.time_limit,
                             optimizer_states=args.states, master_weights=args.master, disk=args.disk,
                             tile_bytes=None if args.tile_bytes is None else parse_size(args.tile_bytes))

    def captured():
        with tiled(meta, options.tile_bytes or 0):
            capture(meta, b, "", hw.device)
    captured()  # warm-up
    ratios = []
    for i in range(args.repeat):
        start = time.perf_counter()
        captured()  # the capture the compile runs: for the profile's device
        cap = time.perf_counter() - start
        start = time.perf_counter()
        c = compile_model(meta, b, hardware=hw, options=options, time_passes=True)
        total = time.perf_counter() - start
        ratios.append(total / cap)
        s = c.plan.solver
        print(f"repeat {i}: capture {cap:.2f} s, compile {total:.2f} s, ratio {total / cap:.2f}; solver {s.status}, "
              f"gap {s.gap:.2%}, {s.seconds:.2f} s; predicted step {c.plan.step_s:.6f} s, peak "
              f"{c.plan.peak_bytes / 2**30:.2f} GiB", flush=True)
    print(f"median compile/capture: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
