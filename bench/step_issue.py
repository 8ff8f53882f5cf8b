"""Where the tail of an exactly clipped step goes: the host's time to issue each optimizer step that
waited for the global norm, against the device's.

With exact clipping every device step waits until backward has ended (NOTE: [Gradient clipping] in
runtime/stepping.py) and then runs with nothing beside it on the device. If issuing a step takes
the host longer than the device takes to run it, the tail is the host's, and the plan, which
prices the device's time, is short by the difference.

    python bench/step_issue.py [--case NAME] [--steps 3] [--warmup 2]     (on the GPU; schedules from
                                                                           `bench/fidelity.py compile`)

Per timed step it prints the deferred steps issued, the host seconds spent issuing them (their sum
and median, and from the coefficient's read to the last one issued), the host's seconds from
then until `step` returns, the device's seconds after that until its work is done, and the step's.
Each GIL switch interval given (`--intervals`, NOTE: [Host steps and the GIL] in
runtime/streams.py) is run in turn.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.fidelity import _schedule_path  # noqa: E402
from bench.fidelity_cases import CASES  # noqa: E402


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--case", default="qwen2.5-1.5b_b16_s1024_24GiB_8bit_bf16_clip-exact")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--intervals", default="0.0002,0.005", help="GIL switch intervals to run with, seconds")
    args = p.parse_args(argv)
    os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    import torch

    from bench.shapes import batch, for_schedule
    from lazytrain.runtime import streams
    from lazytrain.runtime.schedule import load_schedule

    torch.backends.cuda.matmul.allow_tf32 = True
    case = next(c for c in CASES if c.name == args.case)
    path = _schedule_path(case, argparse.Namespace(fuse_stages=True))
    module = load_schedule(path)
    model = for_schedule(module, case.model, case.seq, torch.bfloat16 if case.master == "bf16" else torch.float32)
    data = batch(case.model, case.batch, case.seq, "cuda")
    trainer = module.bind(model, device="cuda", lr=1e-5, max_grad_norm=1.0, fuse_stages=True)
    stepping = trainer.stepping
    issue_log: list[float] = []
    marks: dict[str, float] = {}
    run, after = stepping.run, stepping.after_backward

    def timed_run(e, coef):
        t = time.perf_counter()
        run(e, coef)
        issue_log.append(time.perf_counter() - t)
        marks["last"] = time.perf_counter()

    def timed_after(turn):
        out = after(turn)
        marks["coef"] = time.perf_counter()
        return out
    stepping.run, stepping.after_backward = timed_run, timed_after

    rows = []
    for interval in (float(x) for x in args.intervals.split(",")):
        streams.SWITCH_INTERVAL_S = interval  # a step runs at the smaller of this and the caller's:
        sys.setswitchinterval(max(interval, 0.005))  # the caller's at least Python's default
        for i in range(args.warmup + args.steps):
            issue_log.clear()
            marks.clear()
            start = time.perf_counter()
            trainer.step(data)
            returned = time.perf_counter()
            torch.cuda.synchronize()
            done = time.perf_counter()
            if i < args.warmup or "coef" not in marks:
                continue
            rows.append((interval, len(issue_log), sum(issue_log), statistics.median(issue_log) if issue_log else 0.0,
                         marks.get("last", marks["coef"]) - marks["coef"], returned - marks.get("last", returned),
                         done - returned, returned - start))
    print("switch s | deferred steps | issuing s | median per step ms | coef to last issue s | "
          "last issue to return s | device after return s | step s")
    for r in rows:
        print(f"{r[0]:.4f} | {r[1]} | {r[2]:.3f} | {r[3] * 1e3:.2f} | {r[4]:.3f} | {r[5]:.3f} | {r[6]:.3f} | {r[7]:.3f}")


if __name__ == "__main__":
    main()
