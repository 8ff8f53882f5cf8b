"""Fused stage bodies: each block kind's stage function compiled once by `torch.compile` (Inductor).

NOTE: [Fused stages]
A schedule's stage functions are unfused ATen, one kernel per op: on the H200 the element-wise ops
between a 7B layer's matmuls are about 15 % of its time (one layer, 32 x 1024 tokens, bf16: 84.6 ms
eager, 72.4 ms compiled by Inductor, 2026-12-02). `fuse(stages)` compiles the stage functions with
`torch.compile(fullgraph=True, dynamic=False)` and returns the stages with the compiled callables in
place of `fn`; the schedule's text, the readable reference, is unchanged.
  - One compile per body, not per stage: stages of one block kind (pass `blocks`) are generated from
    the same graph, so their functions differ only in names. Two functions whose bytecode, constants,
    global names and argument counts are equal compute the same thing from the same positional
    arguments, so the stages that share a body call one compiled function; its guards (shapes,
    dtypes, strides, requires_grad) are the same for every layer of the kind, so its graphs are
    traced once and reused. A kind is two to four graphs: forward with autograd, forward without
    (a recomputed stage's first forward), the recompute before backward (`remat=True`), and a
    second size where the batch's shape differs (an evaluation batch).
  - The plan's choices hold at stage granularity, as they do eager: a stage whose internals are
    saved runs its compiled forward under autograd and keeps what AOTAutograd's partitioner saves;
    a recomputed stage runs it without autograd and again, with, before its backward. Inductor's
    partitioner saves fewer bytes than eager autograd does (it recomputes cheap element-wise work in
    backward), so a fused stage's memory is at most the plan's.
  - Left eager: stages that draw random numbers (their recompute replays the forward's generator
    state, NOTE: [RNG replay] in rng.py, which Inductor's own random streams do not follow), chunked
    loss stages (their slices run in chunked.py), and stages whose compile fails, with a warning
    naming the stage and the error: a fused body is an optimisation, never a reason to stop.
Compiled kernels are cached on disk by Inductor (its FX graph and AOTAutograd caches, keyed by the
graph), so a second run of the same schedule compiles in seconds; `compile_seconds()` reports the
time spent compiling so far, which `lazytrain train` prints and keeps out of the step's figure.
"""

from __future__ import annotations

import dataclasses
import time
import warnings
from types import CodeType
from typing import Callable

import torch


def _body(code: CodeType, doc: str | None = None) -> tuple:
    """What a function computes, without its names or docstring (which names its stage): equal
    bodies compute equal values from equal positional arguments."""
    consts = code.co_consts[1:] if doc is not None and code.co_consts[:1] == (doc,) else code.co_consts
    return (code.co_code, code.co_names, code.co_argcount, code.co_kwonlyargcount,
            tuple(_body(c) if isinstance(c, CodeType) else c for c in consts))


def fusable(stage) -> bool:
    """Whether a stage's body is compiled (NOTE: [Fused stages]): not a chunked loss, nor random."""
    return stage.chunks == 1 and not stage.random


class _Timed:
    """A compiled stage function that adds the wall time of its calls that compiled to `seconds`."""

    seconds = 0.0

    def __init__(self, compiled: Callable, fallback: Callable, name: str):
        self.compiled, self.fallback, self.name = compiled, fallback, name
        self.failed = False

    def __call__(self, *args, **kwargs):
        if self.failed:
            return self.fallback(*args, **kwargs)
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        start = time.perf_counter()
        try:
            out = self.compiled(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001  (any compile failure: the eager body is the same step)
            self.failed = True
            warnings.warn(f"fused stages: {self.name} runs eager, its compile failed: {type(exc).__name__}: "
                          f"{str(exc).splitlines()[0] if str(exc) else ''}", stacklevel=2)
            return self.fallback(*args, **kwargs)
        if torch._dynamo.utils.counters["stats"]["unique_graphs"] != frames:
            _Timed.seconds += time.perf_counter() - start
        return out


def fuse(stages) -> tuple:
    """`stages` with each fusable stage's `fn` compiled, one compile per distinct body."""
    compiled: dict[tuple, _Timed] = {}
    out = []
    for stage in stages:
        if not fusable(stage):
            out.append(stage)
            continue
        key = _body(stage.fn.__code__, stage.fn.__doc__)
        if key not in compiled:
            fn = torch.compile(stage.fn, fullgraph=True, dynamic=False)
            compiled[key] = _Timed(fn, stage.fn, f"stage {stage.index} ({stage.name}, kind {stage.kind})")
        out.append(dataclasses.replace(stage, fn=compiled[key]))
    return tuple(out)


def compile_seconds() -> float:
    """Seconds spent in calls of fused stages that compiled a graph, in this process so far."""
    return _Timed.seconds


def bodies(stages) -> int:
    """How many distinct compiled bodies `stages` call (the compiles a first step runs)."""
    return len({id(s.fn) for s in stages if isinstance(s.fn, _Timed)})
