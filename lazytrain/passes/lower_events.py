"""The event builder of pass `lower`: each event appended with the waits its buffers imply (what
made a buffer it reads, overwrites or frees; what read a buffer it overwrites, frees or makes again),
only those across streams kept, and its predicted start and duration; the buffers by name."""

from __future__ import annotations

from lazytrain.ir.events import Buffer, Event, Kind, Stream


class EventBuilder:
    """The events `lower` emits, in order, with the cross-stream waits their buffers imply and
    predicted times, and the buffers they name."""

    def __init__(self):
        self.events: list[Event] = []
        self.buffers: dict[str, Buffer] = {}
        self.last_writer: dict[str, int] = {}
        self.readers: dict[str, list[int]] = {}
        self.t = 0.0  # start of the current window
        self.stream_free: dict[Stream, float] = {}
        self.end: list[float] = []
        self.duration = lambda kind, stage, phase, moved: 0.0

    def buffer(self, name, pool, nbytes, persistent=False):
        self.buffers.setdefault(name, Buffer(name, pool, int(nbytes), persistent))
        return name

    def emit(self, stream, kind, stage, phase=None, reads=(), allocs=(), frees=(), workspace=0, device="", moved=None,
             after=(), writes=()):
        eid = len(self.events)
        waits = set(after)
        for b in reads:
            if b in self.last_writer:
                waits.add(self.last_writer[b])
        for b in writes:  # overwriting in place: after what made it and everything that read it
            waits.update(self.readers.get(b, ()))
            if b in self.last_writer:
                waits.add(self.last_writer[b])
        for b in frees:
            waits.update(self.readers.get(b, ()))
            if b in self.last_writer:
                waits.add(self.last_writer[b])
        for b in allocs:  # reusing a name: wait until its previous life is over
            waits.update(self.readers.get(b, ()))
        # same-stream order is implicit: keep only cross-stream waits
        waits = tuple(sorted(w for w in waits if self.events[w].stream is not stream))
        # predicted timing: after the window opens, the stream is free and what it waits on is done
        start = max([self.t, self.stream_free.get(stream, 0.0)] + [self.end[w] for w in waits])
        if moved is None:  # a FREE moves nothing unless it says so (NOTE: [Boundary tiles] in solver/boundary.py)
            moved = 0 if kind is Kind.FREE else self.buffers[(allocs or reads or ("fixed",))[0]].bytes
        duration = self.duration(kind, stage, phase, moved)
        self.stream_free[stream] = start + duration
        self.end.append(start + duration)
        self.events.append(Event(eid, stream, kind, stage, phase, tuple(reads), tuple(allocs), tuple(frees),
                                 waits, tuple(writes), int(workspace), device, round(start, 9), round(duration, 9)))
        for b in reads:
            self.readers.setdefault(b, []).append(eid)
        for b in tuple(allocs) + tuple(writes):
            self.last_writer[b] = eid
            self.readers[b] = []
        return eid
