"""Running events on streams: in order on the CPU; on CUDA streams with events on a GPU.

On a GPU each schedule stream is a CUDA stream (compute is the current stream, so autograd's
backward runs there too); an event first makes its stream wait for the CUDA events of what it
`waits` on, runs, then records its own. The `cpu` stream is one worker thread: a job waits on the
CUDA events it needs, then runs on the host while the GPU works on.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from lazytrain.errors import ResourceError
from lazytrain.host import host_cores
from lazytrain.ir.events import Event, Stream


# NOTE: [Host step threads] A host step is torch's CPU kernels on OpenMP teams of one thread a
# core, each team ending when its slowest thread does, so a core taken by another busy thread
# slows the whole step. At a step's end the main thread waited for the streams with `synchronize`,
# which spins on a core, while the last host steps ran: on the H200 box (16 cores, 2026-12-04) a
# fused Qwen2.5-1.5B step at 40 GiB (fp32 masters, 8 host-stepped blocks) took 0.504 s against 0.365
# predicted (6791165), its 17 ms host steps (`bench/host_step.py`) 33-69 ms; waiting on blocking
# events, which sleep, with teams of 16 threads (`LAZYTRAIN_HOST_THREADS=16`) it took 0.374 s, with
# teams of 15, 0.553 (0db8bfb). So the worker's teams take every CPU the process may run on
# (`host_cores`, from `os.sched_getaffinity`), not torch's own count, which with MKL is the
# physical cores' and may be fewer. On the H200 box both counts are 16 (085b863, 2026-12-04), so this default changes
# nothing there: the same row's 0.551 s at 5d2f71b, host steps at 2.2x their price, was the GIL's
# (NOTE: [Host steps and the GIL]), and 16 against 15 threads above may be too. Where
# OMP_NUM_THREADS or MKL_NUM_THREADS is set (a launcher sharing the host between ranks), torch's
# count is kept; `LAZYTRAIN_HOST_THREADS` sets it outright.
HOST_THREADS_ENV = "LAZYTRAIN_HOST_THREADS"


def host_threads() -> int:
    """The OpenMP team a host step runs on (NOTE: [Host step threads])."""
    given = os.environ.get(HOST_THREADS_ENV, "").strip()
    if given:
        try:
            return max(1, int(given))
        except ValueError:
            raise ResourceError(f"{HOST_THREADS_ENV}={given!r} is not a number of threads; unset it or give one, "
                                f"e.g. {HOST_THREADS_ENV}=8") from None
    if os.environ.get("OMP_NUM_THREADS") or os.environ.get("MKL_NUM_THREADS"):
        return torch.get_num_threads()
    return host_cores()


# NOTE: [Host jobs by deadline] The plan counts the host worker's work against deadlines per
# window (NOTE: [Host step backlog] in solver/backlog.py) as if the most urgent job ran first.
# Disk-stepped stages' jobs (NOTE: [Disk-stepped stages] in solver/disk_model.py) are released in backward from the
# last stage to the first, and each is due at its stage's prefetch in the next forward, from the
# first to the last: run as submitted, the job due first ran last. On the H200 (7B at 24 GiB, 6
# disk-stepped blocks, 2026-12-01) the next forward then waited 0.8 s at the first such block's
# prefetch, in a plan that had room for every job. So jobs given a `due` wait in a pool, and each
# turn of the worker (one per job submitted, after that job's CUDA events) runs the most urgent
# job whose events have completed; its own have, so every job runs. A job already running is not
# interrupted: one due sooner waits for it (up to a layer's job, 0.5 s for the 7B, 1.1 s for the
# 32B, which the plan does not count).
class DeadlineJobs:
    """Host jobs that take turns by deadline (NOTE: [Host jobs by deadline])."""

    def __init__(self):
        self.pending: list[tuple[int, list, Callable[[], object], Future]] = []  # (due, CUDA events, run, future)
        self.lock = threading.Lock()

    def add(self, due: int, events: list, run: Callable[[], object]) -> Future:
        """Pool `run` with its `due` rank (lower: sooner) and the `events` it waits on; its future."""
        f: Future = Future()
        with self.lock:
            self.pending.append((due, events, run, f))
        return f

    def turn(self, events: list) -> None:
        """One job's turn, once `events` (that job's) have completed: the most urgent ready job runs."""
        for ev in events:
            ev.synchronize()
        with self.lock:  # one is ready (each turn follows its own job's events); the first pooled else
            ready = [j for j in self.pending if all(ev.query() for ev in j[1])] or self.pending[:1]
            picked = min(ready, key=lambda j: j[0])
            self.pending.remove(picked)
        _, events, run, f = picked
        for ev in events:
            ev.synchronize()
        try:
            f.set_result(run())
        except BaseException as exc:
            f.set_exception(exc)

    def next_due(self) -> int | None:
        """The `due` of the most urgent job pooled and not started."""
        with self.lock:
            return min((j[0] for j in self.pending), default=None)


class SerialStreams:
    """CPU: every event runs when issued; the schedule's order is valid for all streams."""

    cuda = False

    def __init__(self):
        self.timeline: list[tuple[int, float, float]] | None = None
        self._t0 = 0.0

    def begin(self, record: bool):
        self.timeline = [] if record else None
        self._t0 = time.perf_counter()

    def run(self, e: Event, fn):
        start = time.perf_counter() - self._t0
        fn()
        if self.timeline is not None:
            self.timeline.append((e.id, start, time.perf_counter() - self._t0))

    def host(self, e: Event, fn, due: int | None = None) -> Future:
        f: Future = Future()
        self.run(e, lambda: f.set_result(fn()))
        return f

    def next_due(self) -> int | None:
        return None

    def slot(self, nbytes: int, device: torch.device) -> torch.Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, device=device)

    def run_aside(self, e: Event, fn, after_compute: bool):
        self.run(e, fn)

    def compute_context(self):
        return contextlib.nullcontext()

    def wait_aside(self, stage: int):
        pass

    def stepped_at(self, stage: int):
        pass

    def finish(self):
        return self.timeline

    def abandon(self):
        pass


# NOTE: [Host steps and the GIL] A host step is a few dozen torch calls per tensor, from Python
# (and the bf16 rounding noise's pool threads), and each call needs the GIL back after its kernel.
# While a step runs the main thread is in Python most of the time (the replay, the compiled
# stages' wrappers), and a thread waiting for the GIL gets it only when the holder's switch
# interval ends, 5 ms by default. On the H200 box (`bench/host_gil.py`, 2026-12-04) a Qwen2.5-7B
# block's bf16-master host step took 0.278 s beside an idle main thread and 5.361 s beside one in
# Python; 1.195 s at a 1 ms interval, 0.551 s at 0.2 ms (a 1.5B block's: 0.077, 1.947, 0.366,
# 0.158 s; fp32 masters suffer less, having fewer calls: 7B 0.044, 0.063, 0.055, 0.054 s). In the
# fused fidelity rows, host steps ran 1.4-2.4x their price; at 0.2 ms the 7B at 40 GiB ran 3.19 s
# (3.09 predicted) against 4.05, with fp32 masters 3.53 (3.30) against 4.27, and the 1.5B at
# 24 GiB 0.41 (0.43) against 0.56. So while a step runs the interval is `SWITCH_INTERVAL_S`; the
# caller's is put back when the step's streams finish.
SWITCH_INTERVAL_S = 2e-4


class CudaStreams:
    cuda = True

    def __init__(self, device: torch.device):
        self.device = device
        # NOTE: [Optimizer stream] in stepping.py: compute gets a stream of its own and optimizer
        # steps run on the device's default stream, where bitsandbytes launches them
        self.streams = {Stream.COMPUTE: torch.cuda.Stream(device),
                        Stream.H2D: torch.cuda.Stream(device), Stream.D2H: torch.cuda.Stream(device),
                        Stream.COMM: torch.cuda.Stream(device)}
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="lazytrain-cpu",
                                         initializer=torch.set_num_threads, initargs=(host_threads(),))
        self.by_deadline = DeadlineJobs()
        self.aside = torch.cuda.default_stream(device)  # NOTE: [Optimizer stream]
        self.stepped: dict[int, torch.cuda.Event] = {}  # stage -> its step on the optimizer stream
        self.done: dict[int, torch.cuda.Event] = {}
        self.record = False
        self.marks: list[tuple[int, torch.cuda.Event, torch.cuda.Event]] = []
        self.switch_interval = sys.getswitchinterval()

    def compute_context(self):
        """Work outside events that reads compute's results (the batch, the gradient norm)."""
        return torch.cuda.stream(self.streams[Stream.COMPUTE])

    def begin(self, record: bool):
        self.switch_interval = sys.getswitchinterval()  # NOTE: [Host steps and the GIL]
        sys.setswitchinterval(min(self.switch_interval, SWITCH_INTERVAL_S))
        self.done = {}
        self.record = record
        self.marks = []
        self.host_marks: list[tuple[int, float, float]] = []
        if record:  # the GPU is idle here (the last step ended with a sync): one clock for both
            self.t0 = torch.cuda.Event(enable_timing=True)
            self.t0.record(self.streams[Stream.COMPUTE])
            self.host_t0 = time.perf_counter()

    def stream(self, s: Stream) -> torch.cuda.Stream:
        return self.streams[s]

    def slot(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """A buffer from the compute stream's pool that the copy streams may fill and drain
        (NOTE: [Slots] in store.py): H2D waits for the compute work issued so far (the memory's
        previous users)."""
        compute = self.streams[Stream.COMPUTE]
        with torch.cuda.stream(compute):
            buf = torch.empty(nbytes, dtype=torch.uint8, device=device)
        made = torch.cuda.Event()
        made.record(compute)
        self.streams[Stream.H2D].wait_event(made)
        return buf

    def run(self, e: Event, fn, on: torch.cuda.Stream | None = None):
        """`fn` on its event's stream (or `on`), after the events it waits on."""
        s = on if on is not None else self.streams[e.stream]
        for w in e.waits:
            if w in self.done:
                s.wait_event(self.done[w])
        with torch.cuda.stream(s):
            if self.record:
                start = torch.cuda.Event(enable_timing=True)
                start.record(s)
            fn()
            ev = torch.cuda.Event(enable_timing=self.record)
            ev.record(s)
        self.done[e.id] = ev
        if self.record:
            self.marks.append((e.id, start, ev))

    def run_aside(self, e: Event, fn, after_compute: bool):
        """A device optimizer step on the optimizer stream (NOTE: [Optimizer stream]). With
        `after_compute` it first waits for the compute work issued so far (the gradients it reads)."""
        if after_compute:
            self.aside.wait_stream(self.streams[Stream.COMPUTE])
        self.run(e, fn, on=self.aside)
        self.stepped[e.stage] = self.done[e.id]

    def wait_aside(self, stage: int):
        """Compute reads `stage`'s weights next: they must be stepped."""
        ev = self.stepped.pop(stage, None)
        if ev is not None:
            self.streams[Stream.COMPUTE].wait_event(ev)

    def stepped_at(self, stage: int):
        """`stage`'s weights are final once the work issued so far on the current stream (its
        GATHER's, from inside that event) is done: the next compute that reads them waits for it, as
        for a step (`wait_aside`). Called while the GATHER runs, before `run` has recorded the
        event's own completion."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        self.stepped[stage] = ev

    def host(self, e: Event, fn, due: int | None = None) -> Future:
        """Run `fn` on the CPU worker once the CUDA events `e` waits on have completed. Jobs with a
        `due` (their deadline's rank) take turns by it (NOTE: [Host jobs by deadline])."""
        events = [self.done[w] for w in e.waits if w in self.done]
        record, marks = self.record, self.host_marks

        def run():
            start = time.perf_counter()
            out = fn()
            if record:
                marks.append((e.id, start - self.host_t0, time.perf_counter() - self.host_t0))
            return out
        if due is not None:
            f = self.by_deadline.add(due, events, run)
            self.worker.submit(self.by_deadline.turn, events)
            return f

        def job():
            for ev in events:
                ev.synchronize()
            return run()
        return self.worker.submit(job)

    def next_due(self) -> int | None:
        return self.by_deadline.next_due()

    def abandon(self):
        """A step that raised: the caller's switch interval back (NOTE: [Host steps and the GIL])."""
        sys.setswitchinterval(self.switch_interval)

    def finish(self):
        # blocking events: this thread sleeps while host steps may still run (NOTE: [Host step threads])
        ends = [self.aside] if self.record else []  # its events must have completed to be read
        for s in ends + list(self.streams.values()):
            end = torch.cuda.Event(blocking=True)
            end.record(s)
            end.synchronize()
        self.abandon()
        if not self.record:
            return None
        gpu = [(i, self.t0.elapsed_time(a) / 1e3, self.t0.elapsed_time(b) / 1e3) for i, a, b in self.marks]
        return sorted(gpu + self.host_marks)  # host jobs still running at this point are left out
