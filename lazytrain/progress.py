"""Word from a compile that runs long.

NOTE: [Compile progress]
Most compiles take seconds, but some take minutes: a 14B with 8-bit states at 24 GiB about two
(its search overruns; bench/README.md), a 917,504-token row about 30 s, and a refusal of a 70B at
24 GiB on the H200 profile 75 s, four searches that find no plan each followed by the solve that
names the least memory a plan needs (2-core machine, 2026-12-04). A command that says nothing for
that long looks hung. So inside `reporting()` (the CLI's `compile`, and `train` where it compiles)
a pipeline stage still running after `AFTER_S` says so on stderr, with what it is doing, and says
again when it ends; a stage that ends sooner says nothing, so a quick compile prints as before.
"""

from __future__ import annotations

import contextlib
import contextvars
import sys
import threading
import time

AFTER_S = 5.0

_ON = contextvars.ContextVar("lazytrain_progress", default=False)

# what a stage does, in the words a user reads (the pipeline's stage names otherwise)
DOING = {
    "capture": "tracing the model",
    "causal": "proving the attention masks causal",
    "fusion": "tracing the fused stage bodies",
    "solve": "searching for the fastest plan within the budget (and, where none fits, the least memory one needs)",
    "minimum": "searching for the least memory a plan needs",
    "lower": "laying out the schedule's events",
    "verify": "checking the schedule",
}


@contextlib.contextmanager
def reporting():
    """Stages run inside this say so when they run long (NOTE: [Compile progress])."""
    token = _ON.set(True)
    try:
        yield
    finally:
        _ON.reset(token)


@contextlib.contextmanager
def stage(name: str, after_s: float | None = None):
    """Around one pipeline stage: on stderr, a line if it is still running after `after_s` seconds
    (default `AFTER_S`) and one when it then ends; nothing outside `reporting()`."""
    if not _ON.get():
        yield
        return
    start, said = time.perf_counter(), threading.Event()

    def say():
        print(f"[lazytrain] {DOING.get(name, name)} ...", file=sys.stderr, flush=True)
        said.set()
    timer = threading.Timer(AFTER_S if after_s is None else after_s, say)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()
        timer.join()
        if said.is_set():
            print(f"[lazytrain] {name}: {time.perf_counter() - start:.0f} s", file=sys.stderr, flush=True)
