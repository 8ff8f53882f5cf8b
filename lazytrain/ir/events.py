"""The event IR: what a schedule holds and the runtime replays.

Imports nothing beyond the standard library: a schedule compiled on a laptop runs on a GPU box that
has neither the solver nor networkx.

NOTE: [Disk I/O beside the events]
The disk tier's reads and writes are no events: no stream of this IR carries them, and `verify`
does not replay them. They move bytes between the offload file and page-locked host buffers only,
on the runtime's disk worker threads (runtime/disk.py), never to or from the device. What `verify`
checks is device memory event by event, and every byte that reaches the device from the disk tier
does so through an event it checks: the PREFETCH, RELOAD or OPT_STEP that reads the host buffer.
What the disk I/O itself needs is checked elsewhere: its host buffers (the staging buffer and the
rings) are in the plan's host bytes, its seconds in the windows it runs in are bounded by the step
model (NOTE: [One disk] in solver/disk_model.py), and its order is kept by the buffers themselves:
a reload waits for the read that fills its buffer (runtime/disk_states.py, runtime/disk_acts.py).
An event per disk transfer would put host-side waits into a device-memory check and make every
schedule with the disk tier longer, for no check `verify` could make of them.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass


class Stream(enum.Enum):
    # GPU work and copies, each in order on its own stream
    COMPUTE = "compute"
    H2D = "h2d"
    D2H = "d2h"
    # collectives between data-parallel ranks (reduce-scatter, all-gather), in order on their own stream
    COMM = "comm"
    # host-side work (the CPU optimizer step)
    CPU = "cpu"


class Kind(enum.Enum):
    # data movement
    PREFETCH = "prefetch"  # a stage's weights host -> GPU buffer
    OFFLOAD = "offload"  # activations or gradients GPU -> host
    RELOAD = "reload"  # offloaded activations host -> GPU
    FREE = "free"  # release a buffer at its last use
    # work
    COMPUTE = "compute"
    OPT_STEP = "opt_step"
    REDUCE = "reduce"  # reduce-scatter of a stage's gradients over the data-parallel ranks (each keeps its shard)
    GATHER = "gather"  # all-gather of a stage's updated weights from every rank's shard


class Phase(enum.Enum):
    FWD = "fwd"
    BWD = "bwd"
    RECOMPUTE = "recompute"  # forward again without autograd, to regenerate dropped outputs


@dataclass(frozen=True, slots=True)
class Buffer:
    """A statically planned buffer. Names: w:S (streamed weights), g:S (their grads), act:S (stage
    outputs), saved:S (autograd internals), grad:S (grads of stage outputs), host:act:S, and the
    persistent `fixed`, `shared`, `res:S` (resident weights, grads, optimizer states)."""

    name: str
    pool: str  # "gpu" or "host"
    bytes: int
    persistent: bool = False


@dataclass(frozen=True, slots=True)
class Event:
    id: int
    stream: Stream
    kind: Kind
    stage: int  # -1: the shared (tied) parameters
    phase: Phase | None = None
    reads: tuple[str, ...] = ()
    allocs: tuple[str, ...] = ()
    frees: tuple[str, ...] = ()
    waits: tuple[int, ...] = ()
    writes: tuple[str, ...] = ()  # live buffers it overwrites in place (a GATHER fills the weights)
    workspace: int = 0  # transient bytes while the event runs
    device: str = ""  # OPT_STEP: "gpu", "cpu", or "disk" (a disk-stepped stage's job on the host worker)
    start_s: float = 0.0  # predicted start within the step
    duration_s: float = 0.0  # predicted
