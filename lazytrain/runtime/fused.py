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
    state, NOTE: [RNG replay] in rng.py, which Inductor's own random streams do not follow), and
    stages whose compile fails, with a warning naming the stage and the error, but for a plan
    priced fused on a GPU (below). A chunked loss stage compiles its slice body (below).

NOTE: [Compiled loss slices]
A chunked loss stage (final norm, lm_head, cross-entropy; NOTE: [Chunked loss] in chunked.py) calls
its body once per slice; compiled, every slice of one shape runs one graph (with autograd in the
step, without in an evaluation; a shorter last slice of row chunks is one more). Its `whole_fn`, run
once a step, stays eager. Measured on the 7B 24 GiB plan's loss stage (64 slices of 512 tokens,
vocabulary 152,064, bf16; bench/loss_head.py on an H100, 2026-12-05, 1b17185): eager 328.5 ms,
compiled 255.6 ms (22 % less), at the same peak beyond its inputs (2.42 and 2.41 GiB). So the plan
prices it as it does the layers, at the fused factor of its element-wise time (the H200 profile's
cost model puts 83.7 of its 316.2 ms there: 20 % less at 0.252), and counts eager's bytes, which
the compiled slice did not exceed there (one shape, one card): the fused-transient trace
(analysis/fused_transients.py) replays one unchunked body, not k slices. For that reason a slice
body whose compile fails falls back to eager with a warning, even in a plan priced fused: its
bytes are eager's (`compiled_bytes` in ir/stages.py decides both).

NOTE: [Fused plans run fused]
A plan priced fused counts what each compiled body saves for backward, fewer bytes than eager
autograd saves (NOTE: [Fused saved activations] in analysis/fused_saved.py: 31 % fewer for a 7B
layer). Its stages run eager could hold more than the budget, so on a GPU such a plan runs compiled
or not at all: `fuse_stages=False` is refused at bind, and a body whose compile fails stops the
step, each naming the fix (recompile with --fuse-stages off). On the CPU, which has no device
budget, both stay a warning and the eager body.
Compiled kernels are cached on disk by Inductor (its FX graph and AOTAutograd caches, keyed by the
graph), so a second run of the same schedule compiles in seconds; `compile_seconds()` reports the
time spent compiling so far, which `lazytrain train` prints and keeps out of the step's figure.
Whether a schedule's stages fuse is the plan's choice (`FUSED`, NOTE: [Fused stage prices] in
passes/fusion.py: fused stages are priced at their fused time); `choose` follows it on a GPU.

NOTE: [Compile cache]
Inductor's caches (FX graphs, AOTAutograd, Triton kernels) go under the plan cache's folder, keyed
as plans are by what the stages compute: `$XDG_CACHE_HOME/lazytrain/inductor/<FINGERPRINT[:16]>`
(else `~/.cache/lazytrain/...`), one folder per traced graph, so schedules of one model and batch
at any budget share their kernels, and removing `~/.cache/lazytrain` removes both caches. `fuse`
points Inductor there (its `TORCHINDUCTOR_CACHE_DIR`, which it reads at each compile) for the whole
process, the folder of the last schedule bound. Inductor still keys each entry by its graph, so a
folder shared or reused never gives a stage another's kernels. A `TORCHINDUCTOR_CACHE_DIR` set
before the runtime is imported is left as it is, and so is Inductor's default under
`LAZYTRAIN_NO_CACHE=1`.
"""

from __future__ import annotations

import dataclasses
import os
import time
import warnings
from pathlib import Path
from types import CodeType
from typing import Callable

import torch

from lazytrain.errors import ScheduleMismatch
from lazytrain.files import cache_dir, caching
from lazytrain.ir.stages import compiled_bytes, fusable

_ASKED_DIR = os.environ.get("TORCHINDUCTOR_CACHE_DIR")  # NOTE: [Compile cache]: the user's, if any

def _body(code: CodeType, doc: str | None = None) -> tuple:
    """What a function computes, without its names or docstring (which names its stage): equal
    bodies compute equal values from equal positional arguments."""
    consts = code.co_consts[1:] if doc is not None and code.co_consts[:1] == (doc,) else code.co_consts
    return (code.co_code, code.co_names, code.co_argcount, code.co_kwonlyargcount,
            tuple(_body(c) if isinstance(c, CodeType) else c for c in consts))


def choose(module, device: torch.device, fuse_stages: bool | None) -> bool:
    """Whether a trainer on `device` runs `module`'s stage bodies compiled: None follows the plan
    (`FUSED`) on a GPU and stays eager on the CPU; True or False as asked, with a warning where
    that differs from the plan, whose predicted step times were priced the other way. A plan priced
    fused is refused eager on a GPU (NOTE: [Fused plans run fused])."""
    planned = bool(getattr(module, "FUSED", False))
    if fuse_stages is None:
        return planned and device.type == "cuda"
    if planned and not fuse_stages and device.type == "cuda":
        raise ScheduleMismatch("fuse_stages=False: this schedule was planned with stage bodies compiled (FUSED = True), "
                               "which save fewer activations for backward than eager ones, so run eager its stages "
                               "could outgrow its budget; recompile with --fuse-stages off to train eager")
    if fuse_stages != planned:
        warnings.warn(f"fuse_stages={fuse_stages}: this schedule was planned with stage bodies "
                      f"{'compiled' if planned else 'eager'} (FUSED = {planned}), so its predicted step times price "
                      f"them {'fused' if planned else 'eager'}; recompile with --fuse-stages "
                      f"{'on' if fuse_stages else 'off'} to plan for {'fused' if fuse_stages else 'eager'} bodies",
                      stacklevel=3)
    return fuse_stages


def compile_cache(fingerprint: str) -> Path | None:
    """Where Inductor caches the compiled bodies of a schedule of this graph (NOTE: [Compile cache]):
    None where the user chose the folder, or caching is off."""
    if _ASKED_DIR is not None or not caching():
        return None
    return cache_dir("inductor") / fingerprint[:16]


class _Timed:
    """A compiled stage function that adds the wall time of its calls that compiled to `seconds`.
    Where its compile fails it runs eager, with a warning, unless the plan counted the compiled
    body's memory (`planned`): then it raises (NOTE: [Fused plans run fused])."""

    seconds = 0.0

    def __init__(self, compiled: Callable, fallback: Callable, name: str, planned: bool = False):
        self.compiled, self.fallback, self.name, self.planned = compiled, fallback, name, planned
        self.failed = False

    def __call__(self, *args, **kwargs):
        if self.failed:
            return self.fallback(*args, **kwargs)
        frames = torch._dynamo.utils.counters["stats"]["unique_graphs"]
        start, backward = time.perf_counter(), _backward_compiles()
        try:
            out = self.compiled(*args, **kwargs)
        except Exception as exc:  # noqa: BLE001  (any compile failure: the eager body is the same step)
            reason = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            if self.planned:
                raise ScheduleMismatch(f"fused stages: {self.name} did not compile ({reason}); its plan counted what "
                                       "the compiled body saves for backward, and eager it saves more. Recompile "
                                       "with --fuse-stages off to train eager") from exc
            self.failed = True
            warnings.warn(f"fused stages: {self.name} runs eager, its compile failed: {reason}", stacklevel=2)
            return self.fallback(*args, **kwargs)
        if torch._dynamo.utils.counters["stats"]["unique_graphs"] != frames:  # less a backward compiled here
            _Timed.seconds += time.perf_counter() - start - (_backward_compiles() - backward)
        return out


_BACKWARD = "compile_fx.<locals>.bw_compiler"  # Inductor's timer of a backward graph's compile


def _backward_compiles() -> float:
    """Seconds Inductor spent compiling backward graphs in this process: AOTAutograd compiles a
    fused body's backward at its first backward call, outside the stage's own call (a cold cache
    took 3 s of a CPU test's step, which the step's time had counted)."""
    return sum(torch._dynamo.utils.compilation_time_metrics.get(_BACKWARD, ()))


def fuse(stages, fingerprint: str = "", planned: bool = False) -> tuple:
    """`stages` with each fusable stage's `fn` compiled, one compile per distinct body; Inductor's
    caches under the schedule's `fingerprint` (NOTE: [Compile cache]). `planned`: the plan counted the
    compiled bodies' memory, so a body that does not compile stops the step (`_Timed`)."""
    folder = compile_cache(fingerprint) if fingerprint else None
    if folder is not None:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = str(folder)
    compiled: dict[tuple, _Timed] = {}
    out = []
    for stage in stages:
        if not fusable(stage):
            out.append(stage)
            continue
        key = _body(stage.fn.__code__, stage.fn.__doc__)
        if key not in compiled:
            fn = torch.compile(stage.fn, fullgraph=True, dynamic=False)
            compiled[key] = _Timed(fn, stage.fn, f"stage {stage.index} ({stage.name}, kind {stage.kind})",
                                   planned and compiled_bytes(stage))
        out.append(dataclasses.replace(stage, fn=compiled[key]))
    return tuple(out)


def compile_seconds() -> float:
    """Seconds spent compiling fused stage bodies in this process so far: the calls of fused stages
    that compiled a graph, and the backward graphs compiled (`_backward_compiles`)."""
    return _Timed.seconds + _backward_compiles()


def bodies(stages) -> int:
    """How many distinct compiled bodies `stages` call (the compiles a first step runs)."""
    return len({id(s.fn) for s in stages if isinstance(s.fn, _Timed)})
