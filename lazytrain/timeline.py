"""The timeline view: a schedule's events per stream, predicted and (optionally) measured.

`chrome_trace` builds a Chrome-trace / Perfetto JSON object (open it at ui.perfetto.dev or
chrome://tracing); `plot_png` draws the same lanes with matplotlib. Both take a loaded schedule
module (`load_schedule` / `load_source`) and, optionally, a measured timeline: the list of
(event id, start s, end s) a Trainer leaves in `trainer.timeline` when `record_timeline` is set.
`save_measured` / `load_measured` keep a measured timeline beside its schedule, keyed by the
schedule's fingerprint and checksum.

The predicted GPU memory curve replays the schedule exactly as the verifier does: persistent
gpu-pool buffers are live from the start; events in schedule order add their allocs, drop their
frees, and count their workspace while they run. Each event's sample sits at its predicted start
(times are clamped to never go backwards, since schedule order is not start order across streams),
so every sample is at most BUDGET for a verified schedule.

matplotlib is imported only by `plot_png`; everything else needs the standard library alone.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import ModuleType

from lazytrain.errors import ScheduleMismatch, one_line
from lazytrain.ir.events import Event, Kind, Stream

__all__ = ["chrome_trace", "write_trace", "plot_png", "load_measured", "save_measured", "memory_curve", "event_name"]

PREDICTED_PID, MEASURED_PID = 1, 2
_TID = {s: i + 1 for i, s in enumerate(Stream)}  # lanes in Stream order
_COLOURS = {  # by Kind value; tab10 colours
    "compute": "#1f77b4", "prefetch": "#2ca02c", "offload": "#ff7f0e", "reload": "#9467bd",
    "opt_step": "#d62728", "reduce": "#8c564b", "free": "#7f7f7f",
}


def event_name(module: ModuleType, e: Event) -> str:
    """A short label: "blocks.1 fwd", "prefetch w:3", "free act:2", "opt_step blocks.0 (cpu)"."""
    stage = {s.index: s.name for s in module.STAGES}.get(e.stage, "shared" if e.stage < 0 else f"stage {e.stage}")
    if e.kind is Kind.COMPUTE:
        return f"{stage} {e.phase.value}" if e.phase else stage
    if e.kind is Kind.FREE and e.frees:
        return f"free {e.frees[0]}"
    if e.kind in (Kind.PREFETCH, Kind.OFFLOAD, Kind.RELOAD) and (e.allocs or e.reads):
        return f"{e.kind.value} {(e.allocs or e.reads)[0]}"
    if e.kind is Kind.OPT_STEP:
        return f"opt_step {stage} ({e.device or '?'})"
    return f"{e.kind.value} {stage}"


def memory_curve(module: ModuleType) -> list[tuple[float, int]]:
    """Predicted GPU bytes as (time s, bytes) samples, times non-decreasing: one per distinct event
    start (the largest of the events starting then; see the module docstring), then the persistent
    bytes at the predicted end of the step. Its maximum is the verifier's predicted peak."""
    sizes = {b.name: b.bytes for b in module.BUFFERS if b.pool == "gpu"}
    live = {b.name for b in module.BUFFERS if b.pool == "gpu" and b.persistent}
    samples, t = [], 0.0
    for e in module.EVENTS:
        live |= {n for n in e.allocs if n in sizes}
        t, used = max(t, e.start_s), sum(sizes[n] for n in live) + e.workspace
        live -= set(e.frees)
        if samples and samples[-1][0] == t:  # events starting together: keep the largest
            used = max(used, samples.pop()[1])
        samples.append((t, used))
    end = max([t] + [e.start_s + e.duration_s for e in module.EVENTS])
    samples.append((end, sum(sizes[n] for n in live)))
    return samples


def _check_measured(module: ModuleType, measured) -> list[tuple[int, float, float]]:
    n = len(module.EVENTS)
    rows = [(int(i), float(s), float(t)) for i, s, t in measured]
    bad = [i for i, _, _ in rows if not 0 <= i < n]
    if bad:
        raise ScheduleMismatch(
            f"measured timeline names event ids {bad[:5]} but schedule {module.SOURCE or ''} "
            f"(fingerprint {module.FINGERPRINT}) has events 0..{n - 1}; it was measured with another schedule")
    return rows


def _us(seconds: float) -> float:
    return round(seconds * 1e6, 3)


def _process(module, pid: int, label: str, times: list[tuple[int, float, float]]) -> list[dict]:
    events = module.EVENTS
    used = sorted({e.stream for e in events}, key=_TID.get)
    out = [{"ph": "M", "pid": pid, "tid": 0, "name": "process_name", "args": {"name": label}},
           {"ph": "M", "pid": pid, "tid": 0, "name": "process_sort_index", "args": {"sort_index": pid}}]
    for s in used:
        lane = {"ph": "M", "pid": pid, "tid": _TID[s]}
        out.append({**lane, "name": "thread_name", "args": {"name": s.value}})
        out.append({**lane, "name": "thread_sort_index", "args": {"sort_index": _TID[s]}})
    for i, start, end in times:
        e = events[i]
        args = {"id": e.id, "kind": e.kind.value, "stream": e.stream.value, "stage": e.stage,
                "phase": e.phase.value if e.phase else None, "reads": list(e.reads), "allocs": list(e.allocs),
                "frees": list(e.frees), "waits": list(e.waits), "workspace": e.workspace}
        rec = {"pid": pid, "tid": _TID[e.stream], "name": event_name(module, e), "cat": e.kind.value,
               "ts": _us(max(start, 0.0)), "args": args}
        if e.kind is Kind.FREE or (pid == PREDICTED_PID and e.duration_s <= 0):
            rec.update(ph="i", s="t")
        else:
            rec.update(ph="X", dur=max(_us(max(end, start)) - rec["ts"], 0.0))
        out.append(rec)
    return out


def chrome_trace(schedule_module: ModuleType, measured=None) -> dict:
    """The Chrome-trace JSON object. Process "predicted" (pid 1): one lane (thread) per stream, an
    "X" event per event with predicted duration > 0, an "i" instant per FREE or zero-length event,
    and a "C" counter "GPU memory" (bytes, `memory_curve`). With `measured`, process "measured"
    (pid 2) holds the same lanes at measured times. Times are microseconds from the step start.
    Every event id appears once per process; output depends only on the inputs."""
    m = schedule_module
    predicted = [(e.id, e.start_s, e.start_s + e.duration_s) for e in m.EVENTS]
    trace = _process(m, PREDICTED_PID, "predicted", predicted)
    trace += [{"ph": "C", "pid": PREDICTED_PID, "tid": 0, "name": "GPU memory", "ts": _us(t), "args": {"bytes": b}}
              for t, b in memory_curve(m)]
    if measured is not None:
        trace += _process(m, MEASURED_PID, "measured", _check_measured(m, measured))
    meta = {"source": m.SOURCE, "fingerprint": m.FINGERPRINT, "budget": m.BUDGET,
            "predicted_peak": m.PREDICTED_PEAK, "hardware": getattr(m, "HARDWARE", ""),
            "predicted_step_s": getattr(m, "PREDICTED_STEP_S", None), "events": len(m.EVENTS),
            "windows": [list(w) for w in getattr(m, "WINDOWS", ())], "measured": measured is not None}
    return {"traceEvents": trace, "displayTimeUnit": "ms", "metadata": meta}


def write_trace(schedule_module: ModuleType, path, measured=None) -> Path:
    """Write `chrome_trace(...)` as JSON (sorted keys) to `path`; returns the path."""
    path = Path(path)
    path.write_text(json.dumps(chrome_trace(schedule_module, measured), sort_keys=True) + "\n")
    return path


def _lanes(ax, module, times, title: str) -> None:
    events = module.EVENTS
    streams = sorted({e.stream for e in events}, key=_TID.get)
    row = {s: len(streams) - 1 - k for k, s in enumerate(streams)}  # first stream on top
    for kind in Kind:
        for s in streams:
            spans = [(t0 * 1e3, (t1 - t0) * 1e3) for i, t0, t1 in times
                     if events[i].kind is kind and events[i].stream is s and kind is not Kind.FREE]
            if spans:
                ax.broken_barh(spans, (row[s] - 0.4, 0.8), facecolors=_COLOURS.get(kind.value, "#17becf"),
                               edgecolor="white", linewidth=0.3)
        frees = [(t0 * 1e3, row[events[i].stream]) for i, t0, _ in times if events[i].kind is kind]
        if kind is Kind.FREE and frees:
            ax.vlines([x for x, _ in frees], [y - 0.4 for _, y in frees], [y + 0.4 for _, y in frees],
                      colors=_COLOURS["free"], linewidth=0.6)
    ax.set_yticks(range(len(streams)), [s.value for s in reversed(streams)])
    ax.set_ylim(-0.6, len(streams) - 0.4)
    ax.set_xlabel("time (ms)")
    ax.set_title(title, fontsize=9, loc="left")
    ax.grid(axis="x", alpha=0.3)


def plot_png(schedule_module: ModuleType, path, measured=None) -> Path:
    """Draw the timeline to a PNG at `path` (dpi 110): predicted lanes on top, measured lanes
    (own time axis) below when given, and predicted GPU memory with the budget at the bottom.
    Renders with the Agg canvas directly (no pyplot, no global backend or rcParams changes)."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.patches import Patch

    from lazytrain.units import format_size

    m = schedule_module
    rows = _check_measured(m, measured) if measured is not None else None
    panels = 3 if rows is not None else 2
    fig = Figure(figsize=(12, 2.2 * panels + 0.8))
    FigureCanvasAgg(fig)
    axes = fig.subplots(panels, 1, gridspec_kw={"height_ratios": [1.0] * (panels - 1) + [0.9]})
    _lanes(axes[0], m, [(e.id, e.start_s, e.start_s + e.duration_s) for e in m.EVENTS], "predicted")
    if rows is not None:
        _lanes(axes[1], m, rows, "measured")
    kinds = sorted({e.kind.value for e in m.EVENTS})
    axes[0].legend(handles=[Patch(color=_COLOURS.get(k, "#17becf"), label=k) for k in kinds], loc="lower right",
                   bbox_to_anchor=(1.0, 1.0), fontsize=7, ncol=len(kinds), frameon=False, borderaxespad=0.2)
    scale, unit = next((1024.0 ** p, u) for p, u in ((3, "GiB"), (2, "MiB"), (1, "KiB"), (0, "B"))
                       if m.BUDGET >= 1024.0 ** p or p == 0)
    curve = memory_curve(m)
    mem = axes[-1]
    mem.step([t * 1e3 for t, _ in curve], [b / scale for _, b in curve], where="post", color="#1f77b4",
             label="predicted GPU memory")
    mem.axhline(m.BUDGET / scale, color="#d62728", linestyle="--", linewidth=1, label=f"budget {format_size(m.BUDGET, round_up=True)}")
    mem.set_xlim(axes[0].get_xlim())
    mem.set_ylim(0, m.BUDGET / scale * 1.1)
    mem.set_ylabel(unit)
    mem.set_xlabel("predicted time (ms)")
    mem.legend(loc="lower right", bbox_to_anchor=(1.0, 1.0), fontsize=7, ncol=2, frameon=False, borderaxespad=0.2)
    mem.grid(alpha=0.3)
    fig.suptitle(f"{m.SOURCE or 'schedule'} ({m.FINGERPRINT}): budget {format_size(m.BUDGET, round_up=True)}, "
                 f"predicted peak {format_size(m.PREDICTED_PEAK)}", fontsize=10)
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110, format="png")
    fig.clear()
    return path


def save_measured(path, timeline, schedule: ModuleType) -> Path:
    """Write `{"fingerprint": ..., "checksum": ..., "events": [[id, start, end], ...]}` to `path`,
    keyed by the schedule's graph fingerprint and its own checksum (two plans of one model share
    the fingerprint, not the events); returns the path."""
    path = Path(path)
    rows = [[int(i), float(s), float(t)] for i, s, t in timeline]
    path.write_text(json.dumps({"fingerprint": schedule.FINGERPRINT, "checksum": getattr(schedule, "CHECKSUM", None),
                                "events": rows}, sort_keys=True) + "\n")
    return path


def load_measured(path, schedule_module: ModuleType | None = None) -> list[tuple[int, float, float]]:
    """Read a `save_measured` file. With `schedule_module`, raises ScheduleMismatch when the file was
    measured with another schedule: another model (fingerprint), another plan (checksum), or event
    ids the schedule does not have."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
        fingerprint, rows = data["fingerprint"], [(int(i), float(s), float(t)) for i, s, t in data["events"]]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ScheduleMismatch(f"{path} is not a measured timeline ({one_line(exc)}); "
                               "write one with `lazytrain.timeline.save_measured`") from None
    if schedule_module is not None:
        if fingerprint != schedule_module.FINGERPRINT:
            raise ScheduleMismatch(
                f"{path} was measured with schedule fingerprint {fingerprint}, but this schedule "
                f"({schedule_module.SOURCE or ''}) has fingerprint {schedule_module.FINGERPRINT}; "
                "measure it again with this schedule")
        checksum = data.get("checksum")
        if checksum is not None and checksum != getattr(schedule_module, "CHECKSUM", checksum):
            raise ScheduleMismatch(
                f"{path} was measured with another plan of this model (schedule checksum {checksum}, this one "
                f"{schedule_module.CHECKSUM}); measure it again with this schedule")
        rows = _check_measured(schedule_module, rows)
    return rows
