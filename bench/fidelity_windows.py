"""The plan's windows against the device's (bench/fidelity.py): which window an event belongs to, the
seconds each window took from its first compute to the next window's, and the plan's bytes in each,
as the step model counts them and as `verify`'s event trace holds them over the same events."""

from __future__ import annotations


def _windows(module, timeline) -> list[dict]:
    """Per window of the plan: predicted bytes; and seconds from the window's first compute event
    to the next window's (the last: to the end of the compute stream), measured on `timeline` and
    predicted on the events' planned starts alike (a window with no compute of its own is folded
    into the one before)."""
    measured = _spans(module, {e_id: (a, b) for e_id, a, b in timeline})
    predicted = _spans(module, {e.id: (e.start_s, e.start_s + e.duration_s) for e in module.EVENTS})
    by_event = _event_bytes(module)
    return [{"window": lab, "predicted_bytes": nbytes, "predicted_event_bytes": by_event.get(lab),
             "predicted_s": predicted.get(lab), "measured_s": measured.get(lab)}
            for lab, nbytes, _ in module.WINDOWS]


# NOTE: [Windows by planned start]
# A window's measured bytes are the most allocated while the events planned to start in it were
# issued. The plan's own window figure (`WINDOWS`, the step model's row) counts an event in the window
# whose work it serves, which is not always where it starts: on 1 x 262,144 tokens (2026-12-05) the
# loss stage's prefetch (its weights and its optimizer step's 9.2 GiB) is planned at the very end of
# F27, the step model counts it in F28, and F27 read 6.48 GiB "over the plan" though the event trace
# of `verify` held it there: 29.2 GiB against 29.0 measured. So each window is also given the most
# of `verify`'s trace (GPU bytes at each event, with its workspace) over the same events as the
# measurement: what a window's gap is taken against.
def _event_bytes(module) -> dict[str, int]:
    """Per window label: the most GPU bytes `verify` holds at the events planned to start in it."""
    from lazytrain.ir.schedule import Schedule
    from lazytrain.passes.verify import verify

    trace = verify(Schedule(tuple(module.EVENTS), tuple(module.BUFFERS), module.BUDGET))
    out: dict[str, int] = {}
    for e, nbytes in zip(module.EVENTS, trace):
        label = _window_of(module, e.start_s)
        out[label] = max(out.get(label, 0), nbytes)
    return out


def _spans(module, times: dict[int, tuple[float, float]]) -> dict[str, float]:
    from lazytrain.ir.events import Stream

    first: dict[str, float] = {}
    end = 0.0
    for e in module.EVENTS:
        if e.stream is Stream.COMPUTE and e.id in times:
            label = _window_of(module, e.start_s)
            a, b = times[e.id]
            first[label] = min(first.get(label, a), a)
            end = max(end, b)
    ordered = [w[0] for w in module.WINDOWS if w[0] in first]
    return {lab: (first[ordered[i + 1]] if i + 1 < len(ordered) else end) - first[lab] for i, lab in enumerate(ordered)}


def _window_of(module, t: float) -> str:
    acc, label = 0.0, module.WINDOWS[0][0]
    for lab, _, secs in module.WINDOWS:
        if acc <= t + 1e-12:
            label = lab
        acc += secs
    return label
