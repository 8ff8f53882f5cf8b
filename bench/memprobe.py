"""Where a schedule's GPU memory goes, event by event, against the plan's prediction.

    python bench/memprobe.py .bench/<case>.py --model qwen2.5-7b --batch 32 --seq 1024   (on the GPU)

Runs two steps of the schedule on the bench model and, for the second, records the caching
allocator's allocated bytes and peak during each event; prints the events with the highest peaks
beside the predicted bytes of their window.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("schedule")
    ap.add_argument("--model", default="qwen2.5-7b")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--seq", type=int, default=1024)
    ap.add_argument("--top", type=int, default=15)
    args = ap.parse_args()
    from bench.shapes import batch, build
    from lazytrain.runtime.schedule import load_schedule

    module = load_schedule(args.schedule)
    bf16 = getattr(module, "MASTER_WEIGHTS", "fp32") == "bf16"  # build as the bench does
    model = build(args.model, args.seq, "cpu", torch.bfloat16 if bf16 else torch.float32)
    trainer = module.bind(model, device="cuda", lr=1e-5)
    data = batch(args.model, args.batch, args.seq, "cuda")
    trainer.step(data)
    torch.cuda.synchronize()
    rows = []
    inner = trainer.streams.run

    def run(e, fn, on=None):
        torch.cuda.reset_peak_memory_stats()
        inner(e, fn, on=on)
        rows.append((torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated(), e))
    trainer.streams.run = run
    trainer.step(data)
    G = 2**30
    window = {}
    for label, nbytes, _ in module.WINDOWS:
        window[label] = nbytes
    names = [s.name for s in module.STAGES]
    print(f"budget {module.BUDGET / G:.1f} GiB, predicted peak {module.PREDICTED_PEAK / G:.2f} GiB, "
          f"measured peak {max(r[0] for r in rows) / G:.2f} GiB, slots {trainer.memory_report()['slot_bytes'] / G:.2f} GiB")
    # per window (by the event's planned start): the most allocated during its events, and the plan's
    starts, t = [], 0.0
    for label, _, secs in module.WINDOWS:
        starts.append((t, label))
        t += secs
    seen: dict[str, int] = {}
    for peak, _, e in rows:
        label = [lab for t0, lab in starts if t0 <= e.start_s + 1e-12][-1] if starts else "-"
        seen[label] = max(seen.get(label, 0), peak)
    print("window  measured  predicted (GiB)")
    for _, label in starts:
        if label in seen:
            print(f"{label:>6} {seen[label] / G:9.2f} {window[label] / G:10.2f}")
    for peak, after, e in sorted(rows, key=lambda r: -r[0])[:args.top]:
        label = (f"F{e.stage}" if e.phase is None or e.phase.value == "fwd" else f"B{e.stage}") if e.stage >= 0 else "-"
        print(f"{peak / G:7.2f} GiB peak {after / G:7.2f} after  event {e.id:4d} {e.stream.value:<7} {e.kind.value:<8} "
              f"{names[e.stage] if e.stage >= 0 else 'shared':<16} {e.phase.value if e.phase else '':<9} "
              f"window {label}: {window.get(label, 0) / G:.2f} GiB")


if __name__ == "__main__":
    main()
