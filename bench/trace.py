"""A traced step of a bound schedule on the GPU: what the memory model and the step model are checked
against, event by event (`bench/fidelity.py run --trace`).

  events      per event, in issue order (`event_memory`, the step `fidelity.py` reads per window too):
              (id, bytes allocated before it was issued, the most while it was issued, after); the
              caching allocator allocates as work is issued, so these are the bytes the plan's
              per-event trace (pass `verify`) predicts
  timeline    (event id, start s, end s) of every device event, on one clock with...
  host        ...the host optimizer jobs, which may run on into the next step
  peak        a second step under the allocator's memory history: the blocks live at its most
              allocated moment, summed by the innermost lazytrain frame that allocated them (the
              rest: by the innermost frame); `before` is what was allocated when recording began
  retries     in that step, each allocation the allocator made room for by giving back cached
              pages (a retry: NOTE: [Allocator retries] in lazytrain/train/report.py): its size,
              stream and frame, the bytes given back, and the bytes allocated just before it
  ops         a third step under the profiler: each aten operator's own device seconds, to set
              beside `bench/opcost.py`'s isolated figures (what running inside a schedule costs)
"""

from __future__ import annotations

from collections import defaultdict


def event_memory(trainer, data) -> tuple[float, list[tuple[int, int, int, int]]]:
    """One step with the allocator read as each event is issued and the timeline recorded: its loss,
    and per event (id, bytes allocated before it, the most while it was issued, after)."""
    import torch

    rows = []
    inner = trainer.streams.run

    def run(e, fn, on=None):
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        inner(e, fn, on=on)
        rows.append((e.id, before, torch.cuda.max_memory_allocated(), torch.cuda.memory_allocated()))
    trainer.streams.run = run
    trainer.record_timeline = True
    try:
        loss = trainer.step(data).item()
        trainer.synchronize()
    finally:
        trainer.streams.run = inner
        trainer.record_timeline = False
    return loss, rows


def traced_step(trainer, data, rows) -> dict:
    """`rows` from `event_memory` (the step just run, whose timeline the trainer still holds), and
    a further step under the allocator's memory history."""
    import torch

    out = {"events": rows, "timeline": list(trainer.timeline), "host": list(getattr(trainer.streams, "host_marks", []))}
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=4_000_000, context="alloc", stacks="python")
    try:
        trainer.step(data)
        trainer.synchronize()
        snap = torch.cuda.memory._snapshot()
    finally:
        torch.cuda.memory._record_memory_history(enabled=None)
    out["peak"] = peak_groups(snap, before)
    from bench.fidelity_readings import stream_names

    out["retries"] = retried_allocations(snap, before, stream_names(trainer))
    out["ops"] = profiled_ops(lambda: (trainer.step(data), trainer.synchronize()))
    return out


def profiled_ops(fn) -> dict[str, float]:
    """Each aten operator's own device seconds over one call of `fn` (under the profiler)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.self_device_time_total * 1e-6) for e in prof.key_averages() if e.self_device_time_total > 0]
    out = {k: t for k, t in rows if k.startswith("aten::")}
    # kernels no aten operator launched (bitsandbytes', copies the runtime issues itself) by name
    out.update({f"kernel::{k[:80]}": t for k, t in rows if not k.startswith("aten::") and "bitsandbytes" in k.lower()
                or k.startswith(("kOptimizer", "kPercentile", "Memcpy", "Memset"))})
    return out


def _where(frames) -> str:
    for f in frames:
        if "/lazytrain/" in f["filename"] or "/bench/" in f["filename"]:
            return f"{f['filename'].rsplit('/', 2)[-2]}/{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"
    f = frames[0] if frames else {"filename": "?", "line": 0, "name": "?"}
    return f"{f['filename'].rsplit('/', 1)[-1]}:{f['line']} {f['name']}"


def retried_allocations(snapshot: dict, before: int, streams: dict[int, str]) -> list[dict]:
    """The allocations in the trace that came after the allocator gave pages or segments back (at its
    cap it frees every cached block, a device-wide sync, and tries again): per such allocation its
    size, stream and innermost lazytrain frame, the bytes given back before it, and the bytes
    allocated just before it."""
    trace = next((t for t in snapshot["device_traces"] if t), [])
    out, given_back, total = [], 0, before
    for a in trace:
        if a["action"] in ("segment_unmap", "segment_free"):
            given_back += a["size"]
        elif a["action"] == "alloc":
            if given_back:
                out.append({"size": a["size"], "stream": streams.get(a.get("stream"), str(a.get("stream"))),
                            "where": _where(a.get("frames", [])), "given_back": given_back, "allocated": total})
                given_back = 0
            total += a["size"]
        elif a["action"] == "free_requested":
            total -= a["size"]
    return out


def peak_groups(snapshot: dict, before: int, top: int = 40) -> dict:
    """The blocks live at the trace's most allocated moment, summed by where they were allocated."""
    trace = next((t for t in snapshot["device_traces"] if t), [])
    live: dict[int, tuple[int, str]] = {}
    base = before
    total = best = before
    best_at = -1
    for i, a in enumerate(trace):
        if a["action"] == "alloc":
            live[a["addr"]] = (a["size"], "")
            total += a["size"]
        elif a["action"] == "free_requested":
            size, _ = live.pop(a["addr"], (a["size"], None))
            total -= size
        if total > best:
            best, best_at = total, i
    live, total = {}, before
    for a in trace[:best_at + 1]:
        if a["action"] == "alloc":
            live[a["addr"]] = (a["size"], _where(a.get("frames", [])))
        elif a["action"] == "free_requested":
            if live.pop(a["addr"], None) is None:
                base -= a["size"]  # allocated before recording began
    groups: dict[str, int] = defaultdict(int)
    for size, where in live.values():
        groups[where] += size
    ranked = sorted(groups.items(), key=lambda kv: -kv[1])
    return {"peak_bytes": best, "before_recording": before, "still_live_from_before": base,
            "groups": ranked[:top], "rest_bytes": sum(v for _, v in ranked[top:])}
