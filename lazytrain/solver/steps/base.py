"""The step rule protocol: the hooks the step model and `lower` call, each a no-op by default, and
the registry of rules by kind (`RULES`, filled by the kind modules in `lazytrain/solver/steps/`)."""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import TYPE_CHECKING

from lazytrain.hardware import Hardware
from lazytrain.ir.events import Kind, Stream
from lazytrain.ir.placement import Placement
from lazytrain.ir.stages import Stage, Stages
from lazytrain.solver.footprint import gpu_step_s, master_staging_bytes

if TYPE_CHECKING:
    from lazytrain.passes.lower import Lowering
    from lazytrain.solver.step_model import StepModel


@dataclass
class StageTerms:
    """One stage's facts the step model hands its rules' hooks, and the host worker's seconds they
    report."""
    s: int
    g: Stage
    numel: int  # the parameters this rank steps
    step_s: float  # a device step of them
    # NOTE: [Weights from the master] in solver/footprint.py, where the stage is stepped on the
    # device: the compute-dtype copy the host keeps no more, the slot's staging region, and what a
    # plain prefetch brings beyond the weights (NOTE: [Masters on disk] in solver/disk_model.py:
    # not where the master is on disk)
    copy: int
    staging: int
    extra: int
    # a host step can start once its gradient has landed (B(s-2)), or with exact clipping once
    # backward has ended; it must end before its next prefetch (NOTE: [Host step deadlines])
    release: int
    prefetched: int  # the end of the window before its next prefetch
    # the host worker's seconds due by the host steps' deadline, and the disk's of them; then those
    # due before its next prefetch whatever the clipping (NOTE: [Disk-stepped stages] in
    # solver/disk_model.py)
    host_s: object = 0.0
    host_disk_s: object = 0.0
    job_s: object = 0.0
    job_disk_s: object = 0.0


class StepRule(abc.ABC):
    """One optimizer-step kind's part of the planner. The step model (solver/step_model.py) calls
    the MIP hooks for every stage and every kind, with `x`, the linear expression that is 1 exactly
    where the stage takes this kind (`indicator`), in the walk's order: `home`, `host_work`,
    `transfers` per stage, `tail_bytes` after the walk, `host_bytes` per stage and `host_buffers`
    once the host memory is counted. `lower` (passes/lower.py) calls the lowering hooks for the
    stage's own kind at fixed points of its forward and backward walk. Terms and events of the
    stage's weights, internals and outputs that every kind shares are the walks' own."""

    kind: str = ""

    # ---- the step model ------------------------------------------------------------------------
    @staticmethod
    @abc.abstractmethod
    def indicator(v: dict, s: int):
        """1 where stage `s` takes this kind, 0 elsewhere, over the MIP's binaries `v` (`formulation._vars`)."""

    def home(self, model: StepModel, st: StageTerms, x) -> None:
        """Before the weight slot's terms: what the stage keeps on the device all step, and its
        step's seconds as its backward ends."""

    def host_work(self, model: StepModel, st: StageTerms, x) -> None:
        """The host worker's seconds for the stage, set on `st` (`host_s`, `host_disk_s`, `job_s`,
        `job_disk_s`: the step model releases them once its gradient has landed and gives each its
        deadline), and the rows that close the kind where the disk tier is off."""

    def transfers(self, model: StepModel, st: StageTerms, x) -> None:
        """After the weights' own traffic: the step's state traffic, buffers and device seconds
        around the stage's prefetches."""

    def host_bytes(self, model: StepModel, st: StageTerms, x):
        """Host bytes of the stage beyond a streamed stage's (`host_bytes_streamed`, less a device
        step's master); without sharded state."""
        return 0

    def tail_bytes(self, model: StepModel) -> None:
        """After the walk: device bytes between steps (`model.tail`) that no single stage holds."""

    def host_buffers(self, model: StepModel) -> None:
        """After the host memory is counted: host buffers the kind's stages share."""

    # ---- lower: seconds and buffers ----------------------------------------------------------------
    def step_seconds(self, stages: Stages, s: int, p: Placement, hw: Hardware) -> float:
        """The predicted seconds of stage `s`'s OPT_STEP event: a device step of its parameters."""
        g = stages[s]
        return gpu_step_s(g.param_numel, len(g.params), hw, stages.master_bytes, stages.state_bytes)

    def buffers(self, lo: Lowering, s: int) -> None:
        """The stage's buffers for its weights, gradients and step, before its activations'."""

    def shared_buffers(self, lo: Lowering) -> None:
        """After every stage's buffers: those the kind's stages share."""

    # ---- lower: the forward ------------------------------------------------------------------------
    def prefetch(self, lo: Lowering, s: int) -> None:
        """The forward prefetch of a streamed stage's weights, in the window its lookahead names."""

    def before_forward(self, lo: Lowering, s: int) -> None:
        """After the window's prefetches, before the stage's forward (`pre` for stage 0)."""

    def write_back(self, lo: Lowering, s: int) -> None:
        """In F(s), before its forward: what the stage's step sends back to the host."""

    def after_forward(self, lo: Lowering, s: int) -> None:
        """After its forward has run and its weight slot is freed."""

    # ---- lower: the backward -----------------------------------------------------------------------
    def backward_prefetch(self, lo: Lowering, s: int) -> None:
        """In B(s+1), before that backward: the backward prefetch of its weights."""

    def gradient(self, lo: Lowering, s: int) -> None:
        """In B(s-1) (the tail for stage 0), before that backward: where its gradient goes."""

    def after_backward(self, lo: Lowering, s: int) -> None:
        """After its own backward and its frees."""

    def gradient_landed(self, lo: Lowering, s: int) -> None:
        """In B(s-1) (the tail for stage 0), after that backward, its gradient having gone."""

    def backward_end(self, lo: Lowering, s: int) -> None:
        """In B(s), last of the stage's own events there."""

    def two_later(self, lo: Lowering, s: int) -> None:
        """In B(s-2), after that backward: what the stage held until then."""

    def host_step(self, lo: Lowering, s: int) -> None:
        """Its step on the host worker once its gradient has landed in host memory."""


class StreamedRule(StepRule):
    """What every kind of a streamed stage shares in `lower`: its weight slot and gradient, a plain
    prefetch of its weights before its forward and its backward, its gradient offloaded to a host
    buffer after its backward, and its slot freed after its backward."""

    host_grad = True  # its gradient goes to `host:grad:S` after its backward
    host_grad_persistent = False  # which outlives the step (read at the next one's prefetch)

    def buffers(self, lo: Lowering, s: int) -> None:
        g = lo.stages[s]
        # NOTE: [Weights from the master] in solver/footprint.py: the slot stages the master's largest tensor
        lo.buffer(f"w:{s}", "gpu", g.param_bytes + (master_staging_bytes(g) if lo.from_master[s] else 0))
        lo.buffer(f"g:{s}", "gpu", g.param_bytes)
        if self.host_grad:
            lo.buffer(f"host:grad:{s}", "host", lo.share(g.param_bytes, s), persistent=self.host_grad_persistent)
        if lo.n > 1:
            lo.buffer(f"sg:{s}", "gpu", lo.share(g.param_bytes, s))

    def prefetch(self, lo: Lowering, s: int) -> None:
        # sharded: only this rank's shard of the new weights comes over; the rest from the other ranks
        lo.emit(Stream.H2D, Kind.PREFETCH, s, allocs=(f"w:{s}",), moved=lo.share(lo.weights_bytes(s), s))
        if lo.n > 1:
            lo.gather(s, f"w:{s}")

    def write_back(self, lo: Lowering, s: int) -> None:
        if lo.n > 1 and not lo.zero3:  # the gathered weights back to the host copy the backward prefetch reads
            lo.emit(Stream.D2H, Kind.OFFLOAD, s, reads=(f"w:{s}",))

    def backward_prefetch(self, lo: Lowering, s: int) -> None:
        if lo.zero3:  # NOTE: [Sharded host weights] in runtime/host_weights.py: this rank's shard, then the rest
            lo.emit(Stream.H2D, Kind.PREFETCH, s, allocs=(f"w:{s}",), moved=lo.share(lo.weights_bytes(s), s))
            lo.gather(s, f"w:{s}")
            return
        lo.emit(Stream.H2D, Kind.PREFETCH, s, allocs=(f"w:{s}",), moved=lo.weights_bytes(s))

    def gradient(self, lo: Lowering, s: int) -> None:
        lo.emit(Stream.D2H, Kind.OFFLOAD, s, reads=(f"g:{s}",), allocs=(f"host:grad:{s}",))

    def after_backward(self, lo: Lowering, s: int) -> None:
        lo.emit(Stream.COMPUTE, Kind.FREE, s, frees=(f"w:{s}",))

    def gradient_landed(self, lo: Lowering, s: int) -> None:
        lo.emit(Stream.COMPUTE, Kind.FREE, s, frees=(f"g:{s}",))
        self.host_step(lo, s)


RULES: dict[str, StepRule] = {}


def rule(cls: type[StepRule]) -> type[StepRule]:
    """Registers one instance of `cls` under its `kind` (a kind of ir/placement.py `KINDS`)."""
    RULES[cls.kind] = cls()
    return cls
