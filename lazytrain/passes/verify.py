"""Pass `verify`: replay a schedule's events symbolically and prove it sound.

Needs: a `Schedule`. Guarantees (or `VerifyError` naming the event and buffer):
  - every wait points to an earlier event, and every event reads only buffers that are live;
  - a buffer made (or overwritten: a GATHER's `writes`) on another stream is read only after an
    event that (transitively) waits for it, and overwritten only after every read of the value it
    held (a collective lands the new weights after the reads of the old ones);
  - nothing is freed twice or used after it is freed, and no temporary buffer outlives the step;
  - GPU bytes live at every event (before its frees), plus its workspace, stay within the budget
    less the allocator's reserve.
Returns the memory trace: GPU bytes at each event, for the plan summary and `inspect`.

    PREFETCH w:1 ; COMPUTE 1 fwd (waits 0) ; FREE w:1 ; COMPUTE 1 bwd reads w:1  ->  VerifyError:
    "event 3 (compute stage 1 bwd) reads w:1, freed by event 2"
"""

from __future__ import annotations

from lazytrain.errors import VerifyError
from lazytrain.ir.events import Event
from lazytrain.ir.schedule import Schedule
from lazytrain.units import format_size


def _name(e: Event) -> str:
    phase = f" {e.phase.value}" if e.phase else ""
    return f"event {e.id} ({e.kind.value} stage {e.stage}{phase}, {e.stream.value})"


def verify(schedule: Schedule) -> tuple[int, ...]:
    sizes = {b.name: b for b in schedule.buffers}
    live: dict[str, int] = {}  # buffer -> allocating event (-1: persistent)
    freed_by: dict[str, int] = {}
    for b in schedule.buffers:
        if b.persistent:
            live[b.name] = -1
    writer: dict[str, int] = {}  # buffer -> the event that last wrote its value (its alloc, or a `writes`)
    readers: dict[str, list[int]] = {}  # buffer -> events that read its current value
    before: list[set[int]] = []  # events known to have finished before each event starts
    last_on_stream: dict = {}
    trace = []
    for i, e in enumerate(schedule.events):
        if e.id != i:
            raise VerifyError(f"{_name(e)} is at position {i}; event ids must be their positions")
        known = set()
        for w in e.waits:
            if w >= i:
                raise VerifyError(f"{_name(e)} waits on event {w}, which does not come before it")
            known |= before[w] | {w}
        if e.stream in last_on_stream:
            p = last_on_stream[e.stream]
            known |= before[p] | {p}
        before.append(known)
        last_on_stream[e.stream] = i
        for name in e.reads:
            if name not in sizes:
                raise VerifyError(f"{_name(e)} reads {name}, which is not a planned buffer")
            if name not in live:
                why = f"freed by event {freed_by[name]}" if name in freed_by else "never produced"
                raise VerifyError(f"{_name(e)} reads {name}, {why}")
            src = writer.get(name, live[name])
            if src >= 0 and src not in known:
                raise VerifyError(f"{_name(e)} reads {name} made by event {src} on another stream without waiting for it")
            readers.setdefault(name, []).append(i)
        for name in e.writes:
            if name not in live:
                raise VerifyError(f"{_name(e)} writes {name}, which is not live")
            src = writer.get(name, live[name])
            if src >= 0 and src not in known:
                raise VerifyError(f"{_name(e)} writes {name} made by event {src} on another stream without waiting for it")
            early = [r for r in readers.get(name, ()) if r != i and r not in known]
            if early:
                raise VerifyError(f"{_name(e)} overwrites {name} without waiting for event {early[0]}, which reads it")
            writer[name] = i
            readers[name] = []
        for name in e.allocs:
            if name in live:
                raise VerifyError(f"{_name(e)} makes {name}, which is already live (from event {live[name]})")
            live[name] = i
            writer[name] = i
            readers[name] = []
            freed_by.pop(name, None)
        # an event's frees take effect when it ends: its workspace sits beside them
        used = sum(sizes[n].bytes for n in live if sizes[n].pool == "gpu") + e.workspace
        if used + schedule.reserve > schedule.budget:
            reserve = f" and the allocator's reserve of {format_size(schedule.reserve)}" if schedule.reserve else ""
            raise VerifyError(f"{_name(e)} needs {format_size(used)} of GPU memory{reserve}, over the budget of "
                              f"{format_size(schedule.budget)}")
        for name in e.frees:
            if name not in live:
                raise VerifyError(f"{_name(e)} frees {name}, which is not live")
            del live[name]
            writer.pop(name, None)
            readers.pop(name, None)
            freed_by[name] = i
        trace.append(used)
    leaked = [n for n, src in live.items() if src >= 0 and sizes[n].pool == "gpu"]
    if leaked:
        raise VerifyError(f"GPU buffers {sorted(leaked)} are never freed")
    return tuple(trace)
