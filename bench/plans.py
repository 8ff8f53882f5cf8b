"""Plans of the bench shapes, written and compared: a refactoring of the planner keeps them.

    python -m bench.plans write OUT.json [--only 0,3]   # compile each case here (no GPU), write its plan
    python -m bench.plans compare BEFORE.json AFTER.json

`write` compiles each case for the H200 profile with the plan cache off and records the predicted
step, peak, host and disk bytes, the solver's status and gap, and each stage's decisions (as the
flag list `placement.old_flags` gives, which reads the same before and after placements had a type).
`compare` prints one line per case: whether every decision is the same, and how far the predicted step
and peak moved. A solve stops at a 1 % gap (solver/solve.py GAP), so an unchanged model may still
land on another plan of near-equal value; identical decisions are the strong check, and predictions
within 0.1 % the weaker one.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time

CASES = [  # model, batch, seq, states, master, budget, host memory (then with the disk tier), clipping
    ("qwen2.5-7b", 32, 1024, "8bit", "bf16", "24GiB", "", "off"),
    ("qwen2.5-7b", 32, 1024, "32bit", "fp32", "24GiB", "", "off"),
    ("qwen2.5-7b", 32, 1024, "8bit", "bf16", "24GiB", "", "exact"),
    ("qwen2.5-1.5b", 16, 1024, "8bit", "fp32", "24GiB", "", "off"),
    ("qwen2.5-7b", 32, 1024, "8bit", "bf16", "24GiB", "44GB", "off"),
    ("qwen2.5-7b", 1, 65536, "8bit", "bf16", "40GiB", "36GB", "off"),
    ("qwen2.5-7b", 32, 1024, "8bit", "fp32", "24GiB", "40GB", "off"),
    ("qwen2.5-32b", 16, 1024, "8bit", "bf16", "max", "", "off"),
    ("qwen2.5-72b", 8, 1024, "8bit", "bf16", "max", "128GB", "off"),
]
TOLERANCE = 1e-3  # predicted step and peak, relative


def _name(case) -> str:
    model, b, seq, states, master, budget, host, clip = case
    return f"{model}_b{b}_s{seq}_{budget}_{states}_{master}_clip-{clip}" + (f"_host{host}_disk" if host else "")


def write(out: str, only: str | None) -> None:
    os.environ["LAZYTRAIN_NO_CACHE"] = "1"
    import torch

    from bench.shapes import batch, meta_model
    from lazytrain import hardware
    from lazytrain.ir.placement import old_flags
    from lazytrain.pipeline import compile_model
    from lazytrain.units import parse_size

    profile = hardware.load("h200")
    results = {}
    for i, case in enumerate(CASES):
        if only and str(i) not in only.split(","):
            continue
        model, b, seq, states, master, budget, host, clip = case
        hw = dataclasses.replace(profile, host_memory_bytes=parse_size(host)) if host else profile
        start = time.perf_counter()
        c = compile_model(meta_model(model, seq).to(torch.bfloat16), batch(model, b, seq),
                          hw.max_budget if budget == "max" else parse_size(budget), hw, source="bench", time_limit=120.0,
                          optimizer_states=states, master_weights=master, clipping=clip, disk=bool(host))
        p = c.plan
        results[_name(case)] = dict(step_s=p.step_s, peak=p.peak_bytes, host=p.host_bytes, disk=p.disk_bytes,
                                    status=p.solver.status, gap=p.solver.gap, decisions=[old_flags(d) for d in p.decisions],
                                    placements=[repr(d) for d in p.decisions])
        print(f"{_name(case)}: {p.step_s:.4f} s, peak {p.peak_bytes} B ({time.perf_counter() - start:.0f} s)", flush=True)
        with open(out, "w") as f:  # after every case: a long run keeps what it has
            json.dump(results, f, indent=1)


def compare(before: str, after: str) -> int:
    a, b = json.load(open(before)), json.load(open(after))
    worst = 0.0
    for name in a:
        if name not in b:
            print(f"{name}: missing from {after}")
            continue
        x, y = a[name], b[name]
        same = x["decisions"] == y["decisions"]
        d_step = (y["step_s"] - x["step_s"]) / x["step_s"]
        d_peak = (y["peak"] - x["peak"]) / x["peak"]
        worst = max(worst, abs(d_step), abs(d_peak))
        changed = [i for i, (p, q) in enumerate(zip(x["decisions"], y["decisions"])) if p != q]
        print(f"{name}: decisions {'identical' if same else f'differ at stages {changed}'}; step {x['step_s']:.4f} -> "
              f"{y['step_s']:.4f} s ({d_step:+.3%}), peak {d_peak:+.3%}")
    print(f"largest change {worst:.3%} (tolerance {TOLERANCE:.1%})")
    return 0 if worst <= TOLERANCE else 1


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    w = sub.add_parser("write")
    w.add_argument("out")
    w.add_argument("--only", default=None, help="case indices, comma-separated")
    c = sub.add_parser("compare")
    c.add_argument("before")
    c.add_argument("after")
    args = p.parse_args(argv)
    if args.cmd == "write":
        write(args.out, args.only)
        return 0
    return compare(args.before, args.after)


if __name__ == "__main__":
    sys.exit(main())
