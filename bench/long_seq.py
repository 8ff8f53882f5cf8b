"""Long sequences on the planner: the smallest budget, and a plan's predicted step, with and without
tiled MLPs (NOTE: [Tiled MLP] in lazytrain/kernels/tiled_mlp.py). Compiles only: no GPU.

    python bench/long_seq.py --seq 131072 --tile 0 256MiB        # the Qwen2.5-7B shape, batch 1

For each length and tile setting: the smallest feasible budget (8-bit states, bf16 masters, the
h200 profile), and, where `--budget` is given and feasible, the plan's predicted step and peak.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the package `bench`, not bench/bench.py
from bench import shapes  # noqa: E402
from lazytrain.errors import PlanError  # noqa: E402
from lazytrain.options import CompileOptions  # noqa: E402
from lazytrain.pipeline import compile_model, minimum_budget  # noqa: E402
from lazytrain.units import format_size, parse_size  # noqa: E402


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="qwen2.5-7b")
    p.add_argument("--seq", type=int, nargs="+", default=[131072])
    p.add_argument("--tile", nargs="+", default=["0", "256MiB"], help="--tile-bytes values (0: untiled)")
    p.add_argument("--budget", default=None, help="also compile at this budget, e.g. 24GiB")
    p.add_argument("--disk", action="store_true")
    a = p.parse_args()
    print(f"{'seq':>9} {'MLP tiles':>10} {'min budget':>11} {'budget':>8} {'step s':>8} {'peak':>9} {'compile s':>10}")
    for seq in a.seq:
        for tile in a.tile:
            tile_bytes = 0 if tile == "0" else parse_size(tile)
            model = shapes.meta_model(a.model, seq).to(torch.bfloat16)
            ids = torch.zeros(1, seq, dtype=torch.long)
            batch = {"input_ids": ids, "labels": ids.clone()}
            opts = dict(optimizer_states="8bit", master_weights="bf16", tile_bytes=tile_bytes, disk=a.disk)
            start = time.perf_counter()
            least = minimum_budget(model, batch, "h200", options=CompileOptions(**opts))
            step = peak = "-"
            if a.budget:
                try:
                    c = compile_model(model, batch, hardware="h200",
                                      options=CompileOptions(budget=parse_size(a.budget), **opts))
                    step, peak = f"{c.plan.step_s:.2f}", format_size(c.plan.peak_bytes)
                except PlanError as exc:
                    step = f"refused: {str(exc)[:60]}"
            print(f"{seq:>9} {tile:>10} {format_size(least):>11} {a.budget or '-':>8} {step:>8} {peak:>9} "
                  f"{time.perf_counter() - start:>10.0f}", flush=True)


if __name__ == "__main__":
    main()
