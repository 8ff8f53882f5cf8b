"""Pass `lower`: a `Plan` -> the step's events per stream, with waits, and its static buffers.

Needs: `Stages` and a `Plan` for them. Guarantees: events in an order that respects every
dependency (the CPU runtime replays them in this order); each buffer allocated by one event and freed
by a FREE event at its last use; the live buffers in each window are exactly those `solve` counted
there (NOTE: [The step model] in solver/formulation.py), so `verify` can re-check the budget event by event.

    plan: stage 1 streamed         events: PREFETCH w:1 (h2d) ; COMPUTE 0 fwd ; COMPUTE 1 fwd
                                           (waits on the prefetch) ; FREE w:1 ; ...

The walk emits what every placement shares (compute, recompute, activations and their transfers,
the sharded collectives); each stage's optimizer-step kind adds its buffers and events through its
rule's hooks (solver/steps/), called at fixed points of the walk with the `Lowering` context.
"""

from __future__ import annotations

from lazytrain.hardware import Hardware
from lazytrain.ir.events import Kind, Phase, Stream
from lazytrain.ir.placement import Outputs
from lazytrain.ir.plan import Plan
from lazytrain.ir.schedule import Schedule
from lazytrain.ir.stages import Stages
from lazytrain.passes.lower_events import EventBuilder
from lazytrain.solver.boundary import copy_s, kept_bytes, moved_bytes
from lazytrain.solver.footprint import (
    cast_s,
    deferred_step_bytes,
    fixed_bytes,
    gpu_step_out_bytes,
    prefetches_from_master,
    resident_bytes,
    shared_grad_bytes,
    shared_step_bytes,
)
from lazytrain.solver.shards import (
    comm_s,
    comm_workspace,
    gathers_weights,
    piece,
    resident_sharded_bytes,
    shard_grad_bytes,
    sharded_deferred_bytes,
    sharded_step_bytes,
    shared_step_s,
    sharding,
)
from lazytrain.solver.steps import RULES, StepRule
from lazytrain.solver.workspace import (
    backward_workspace,
    chunk_workspace,
    forward_workspace,
    recompute_workspace,
    saving_workspace,
)


def _durations(stages: Stages, plan: Plan, hw: Hardware):
    """Predicted seconds per event, from the same rates the solver used."""
    def duration(kind: Kind, stage: int, phase: Phase | None, moved: int) -> float:
        g = stages[stage] if stage >= 0 else None
        if kind is Kind.COMPUTE:
            chunked = g.chunks > 1  # its forward runs inside its backward
            if phase is Phase.BWD:
                if chunked:
                    return g.bwd_s + g.fwd_s
                return g.bwd_s + (g.remat_s if plan.decisions[stage].recomputed else 0.0)
            return 0.0 if chunked else g.fwd_s
        if kind is Kind.PREFETCH and plan.decisions[stage].weights.cast_on_use:  # NOTE: [Resident weights cast on use]
            return cast_s(g, hw, stages.master_bytes)
        if kind in (Kind.PREFETCH, Kind.RELOAD):
            return moved / hw.h2d_bandwidth
        if kind is Kind.OFFLOAD:
            return moved / hw.d2h_bandwidth
        if kind is Kind.FREE:  # a kept part's copy (NOTE: [Boundary tiles] in solver/boundary.py)
            return copy_s(moved, hw)
        if kind in (Kind.REDUCE, Kind.GATHER):
            return comm_s(moved, hw, sharding(stages))
        if kind is Kind.OPT_STEP:
            if g is None:
                return shared_step_s(stages, hw)
            p = plan.decisions[stage]
            return RULES[p.kind].step_seconds(stages, stage, p, hw)
        return 0.0
    return duration


class Lowering:
    """What the walk of `lower` and the step rules' hooks share: the events and buffers built so far,
    the plan, and the names and sizes of a stage's buffers and transfers."""

    def __init__(self, stages: Stages, plan: Plan, hw: Hardware):
        self.stages, self.plan, self.hw = stages, plan, hw
        self.dec = dec = plan.decisions
        self.b = EventBuilder()
        self.b.duration = _durations(stages, plan, hw)
        self.M = stages.master_bytes
        self.n = sharding(stages)  # NOTE: [Sharded state] in runtime/sharding.py
        self.zero3 = gathers_weights(stages)  # NOTE: [Sharded host weights] in runtime/host_weights.py
        # NOTE: [Weights from the master] in solver/footprint.py
        self.from_master = [prefetches_from_master(stages, s, d) for s, d in enumerate(dec)]
        self.producers = {s: g.producers for s, g in enumerate(stages)}
        # gradients of resident weights: made by their backward, kept until the next step starts (NOTE:
        # [Resident steps] in solver/footprint.py); the runtime's FREE of one is a no-op
        self.rgrads = {s: f"rgrad:{s}" for s, d in enumerate(dec) if not d.streamed}
        # NOTE: [Resident gradients freed at their step] in solver/footprint.py
        self.freed = {s for s in self.rgrads if s >= 0 and dec[s].step.frees_grads}
        if stages.shared_params:
            self.rgrads[-1] = "rgrad:shared"
        self.stepped: dict[int, int] = {}  # stage -> its OPT_STEP event, for the step's write-back
        self.parts_out: set[int] = set()  # stages whose kept part is apart from their outputs (NOTE: [Boundary tiles])

    def rule(self, s: int) -> StepRule:
        """Stage `s`'s optimizer-step rule."""
        return RULES[self.dec[s].kind]

    def emit(self, *args, **kwargs) -> int:
        return self.b.emit(*args, **kwargs)

    def buffer(self, name, pool, nbytes, persistent=False) -> str:
        return self.b.buffer(name, pool, nbytes, persistent)

    def held_to(self, p: int) -> int:
        """The backward after which stage p's outputs go: its first reader's, or its own when its
        autograd graph holds them (a saving stage)."""
        saving = not self.dec[p].recomputed and self.stages[p].chunks == 1
        return p if saving else self.stages[p].consumers[0]

    def weights(self, s: int) -> tuple[str, ...]:
        """The buffers stage `s`'s compute reads its weights from (a slot cast on use beside the home)."""
        if self.dec[s].streamed:
            return (f"w:{s}",)
        return (f"res:{s}",) + ((f"w:{s}",) if self.dec[s].weights.cast_on_use else ())

    def cast(self, s: int) -> None:
        """NOTE: [Resident weights cast on use] in solver/footprint.py: the weights from the master, before a use."""
        if self.dec[s].weights.cast_on_use:
            self.emit(Stream.COMPUTE, Kind.PREFETCH, s, allocs=(f"w:{s}",), moved=0)

    def acts_in(self, s: int) -> tuple[str, ...]:
        return tuple(f"act:{p}" for p in self.producers[s])

    # ---- NOTE: [Boundary tiles] in solver/boundary.py ---------------------------------------------
    def part_away(self, p: int) -> None:
        """At stage p's last forward reader: its outputs go from the device, all of them or all but
        the device's part of a split, which is copied into `part:p` first."""
        split = self.dec[p].split
        if split is None or not split.device:
            self.emit(Stream.COMPUTE, Kind.FREE, p, frees=(f"act:{p}",))
            return
        self.emit(Stream.COMPUTE, Kind.FREE, p, reads=(f"act:{p}",), allocs=(f"part:{p}",), frees=(f"act:{p}",),
                  moved=kept_bytes(self.stages[p], split))
        self.parts_out.add(p)

    def reload(self, p: int) -> None:
        """Stage p's offloaded outputs back into a whole buffer; the device's part of a split goes
        back in before the first compute that reads them (`part_back`)."""
        self.emit(Stream.H2D, Kind.RELOAD, p, reads=(f"host:act:{p}",), allocs=(f"act:{p}",),
                  moved=moved_bytes(self.stages[p], self.dec[p].split))

    def part_back(self, readers: tuple[int, ...]) -> None:
        """Before a backward-side compute that reads the outputs of `readers`' stages: the device's
        parts of those reloaded copied into them, on the compute stream, and freed."""
        for p in readers:
            if p in self.parts_out:
                self.parts_out.discard(p)
                self.emit(Stream.COMPUTE, Kind.FREE, p, reads=(f"part:{p}",), writes=(f"act:{p}",),
                          frees=(f"part:{p}",), moved=kept_bytes(self.stages[p], self.dec[p].split))

    def step_out_bytes(self, s: int) -> int:
        """What a GPU step of stage `s` writes back (and a step in backward fetches): weights, master, states."""
        g = self.stages[s]
        return gpu_step_out_bytes(g.param_bytes, g.param_numel, self.stages.state_bytes, self.M)

    def weights_bytes(self, s: int) -> int:
        """What a plain prefetch of stage `s` brings, and its step's OFFLOAD of `w:S` sends back: the
        weights, or the fp32 master they are cast from (NOTE: [Weights from the master] in solver/footprint.py)."""
        g = self.stages[s]
        return self.M * g.param_numel if self.from_master[s] else g.param_bytes

    def states_out(self, s: int) -> int:
        """What a GPU step of stage `s` sends back beside its `w:S` OFFLOAD: master and states (a
        rank's share), or the states alone where that OFFLOAD sent the master."""
        g = self.stages[s]
        return self.share(self.step_out_bytes(s) - g.param_bytes, s) - (self.weights_bytes(s) if self.from_master[s] else 0)

    def share(self, nbytes: int, s: int) -> int:
        """A rank's share of stage `s`'s `nbytes` (all of it without sharding)."""
        return piece(nbytes, self.stages[s].param_numel, len(self.stages[s].params), self.n)

    # ---- sharded state (NOTE: [Sharded state] in runtime/sharding.py) --------------------------------
    def gather(self, s: int, buf: str, after=()) -> None:
        """All-gather of stage `s`'s (or the shared, -1) updated weights from every rank's shard into `buf`."""
        st = self.stages
        nbytes, numel, P = (st.shared_bytes, st.shared_numel, len(st.shared_params)) if s < 0 else (
            st[s].param_bytes, st[s].param_numel, len(st[s].params))
        self.emit(Stream.COMM, Kind.GATHER, s, writes=(buf,), after=after, moved=nbytes,
                  workspace=comm_workspace(nbytes, numel, P, self.n))

    def reduce(self, k: int) -> None:
        """Reduce-scatter of stage `k`'s gradients; a streamed stage's shard goes to the host."""
        g, streamed = self.stages[k], self.dec[k].streamed
        self.emit(Stream.COMM, Kind.REDUCE, k, reads=(f"g:{k}" if streamed else self.rgrads[k],), allocs=(f"sg:{k}",),
                  moved=g.param_bytes, workspace=comm_workspace(g.param_bytes, g.param_numel, len(g.params), self.n))
        if streamed:
            self.emit(Stream.D2H, Kind.OFFLOAD, k, reads=(f"sg:{k}",), allocs=(f"host:grad:{k}",))

    def reduced(self, k: int) -> None:
        """After the backward that overlapped stage `k`'s reduce-scatter: its full gradients go, and
        its shard is stepped (a resident stage's new weights then gathered)."""
        if self.dec[k].streamed:
            self.emit(Stream.COMPUTE, Kind.FREE, k, frees=(f"g:{k}",))
            self.emit(Stream.COMPUTE, Kind.FREE, k, frees=(f"sg:{k}",))
            self.rule(k).host_step(self, k)
            return
        self.emit(Stream.COMPUTE, Kind.FREE, k, frees=(self.rgrads[k],))
        step = self.emit(Stream.COMPUTE, Kind.OPT_STEP, k, reads=(f"res:{k}", f"sg:{k}"), device="gpu",
                         workspace=sharded_step_bytes(self.stages, k, self.n))
        self.gather(k, f"res:{k}", after=(step,))


def _buffers(lo: Lowering, hw: Hardware) -> None:
    """The static buffers: fixed and shared weights, then per stage its kind's (weights, gradients,
    step) and its activations', then those the kinds' stages share."""
    stages, n, M = lo.stages, lo.n, lo.M
    shared = resident_bytes(stages.shared_bytes, stages.shared_numel, stages.state_bytes, M)
    lo.buffer("fixed", "gpu", fixed_bytes(stages) - shared + hw.runtime_bytes, persistent=True)
    nshared = len(stages.shared_params)
    if n > 1:
        shared = resident_sharded_bytes(stages.shared_bytes, stages.shared_numel, nshared, stages.state_bytes, M, n)
    lo.buffer("shared", "gpu", shared, persistent=True)
    if stages.shared_params:
        # sharded: the full gradients go at their reduce-scatter, the shard stays
        lo.buffer("rgrad:shared", "gpu", stages.shared_bytes if n > 1 else shared_grad_bytes(stages))
        if n > 1:
            lo.buffer("sg:shared", "gpu", shard_grad_bytes(stages.shared_bytes, stages.shared_numel, nshared, M, n))
    for s, g in enumerate(stages):
        lo.rule(s).buffers(lo, s)
        lo.buffer(f"act:{s}", "gpu", g.out_bytes if g.consumers else 0)
        lo.buffer(f"saved:{s}", "gpu", g.saved_bytes)
        lo.buffer(f"grad:{s}", "gpu", g.grad_out_bytes)
        split = lo.dec[s].split
        if lo.dec[s].outputs.offloaded:
            lo.buffer(f"host:act:{s}", "host", moved_bytes(g, split))
        if split is not None and split.device:  # NOTE: [Boundary tiles] in solver/boundary.py
            lo.buffer(f"part:{s}", "gpu", kept_bytes(g, split))
    for rule in RULES.values():
        rule.shared_buffers(lo)


def lower(stages: Stages, plan: Plan, hw: Hardware) -> Schedule:
    S = len(stages)
    lo = Lowering(stages, plan, hw)
    b, dec, n = lo.b, lo.dec, lo.n
    win_start, acc = {}, 0.0
    for label, _, secs in plan.windows:
        win_start[label] = acc
        acc += secs
    _buffers(lo, hw)

    # ---- forward ----------------------------------------------------------------------------
    b.t = win_start["pre"]
    if dec[0].streamed:
        lo.rule(0).prefetch(lo, 0)
        lo.rule(0).before_forward(lo, 0)
    for s, g in enumerate(stages):
        b.t = win_start[f"F{s}"]
        if s + 1 < S and dec[s + 1].streamed and dec[s + 1].weights.lookahead == 1:
            lo.rule(s + 1).prefetch(lo, s + 1)
        if s + 2 < S and dec[s + 2].weights.lookahead == 2:
            lo.rule(s + 2).prefetch(lo, s + 2)
        if s > 0:
            # Issued after this window's prefetches: a prefetch's slot waits for the compute work
            # issued before it (NOTE: [Slots] in runtime/store.py), so a step issued first and run
            # in compute order would hold up every fetch. (The CUDA runtime runs it beside compute,
            # NOTE: [Optimizer stream] in runtime/stepping.py; the order keeps other runtimes right.)
            lo.rule(s).before_forward(lo, s)
        lo.rule(s).write_back(lo, s)
        for p in lo.producers[s]:
            if dec[p].outputs.offloaded and s == p + 1:
                b.emit(Stream.D2H, Kind.OFFLOAD, p, reads=(f"act:{p}",), allocs=(f"host:act:{p}",))
        save = not dec[s].recomputed and g.chunks == 1
        allocs = ((f"act:{s}",) if g.consumers else ()) + ((f"saved:{s}",) if save else ())
        # a saving forward holds its operators' own workspace beside what it saves (NOTE: [Operator workspace])
        lo.cast(s)
        b.emit(Stream.COMPUTE, Kind.COMPUTE, s, Phase.FWD, reads=("fixed",) + lo.weights(s) + lo.acts_in(s),
               allocs=allocs, workspace=saving_workspace(g) if save else forward_workspace(g))
        if dec[s].streamed and s < S - 1 or dec[s].weights.cast_on_use:
            b.emit(Stream.COMPUTE, Kind.FREE, s, frees=(f"w:{s}",))
        lo.rule(s).after_forward(lo, s)
        for p in lo.producers[s]:
            mode = dec[p].outputs
            if (mode.offloaded and stages[p].consumers[-1] == s) or (mode is Outputs.DROP and s == p + 1):
                lo.part_away(p)

    # ---- backward ---------------------------------------------------------------------------
    for s in reversed(range(S)):
        g = stages[s]
        b.t = win_start[f"B{s}"]
        if s - 1 >= 0:
            lo.rule(s - 1).backward_prefetch(lo, s - 1)
        for p in range(S):
            if dec[p].outputs.offloaded and stages[p].consumers[-1] + 1 == s:
                lo.reload(p)
        if s + 1 < S and n > 1:  # the last backward's stage: its gradient reduce-scattered beside this backward
            lo.reduce(s + 1)
        elif s + 1 < S:
            lo.rule(s + 1).gradient(lo, s + 1)
        if s >= 1 and dec[s - 1].outputs is Outputs.DROP and dec[s].outputs is not Outputs.DROP:
            j = s - 1
            while j - 1 >= 0 and dec[j - 1].outputs is Outputs.DROP:
                j -= 1
            for i in range(j, s):  # regenerate the dropped segment bottom-up
                lo.part_back(lo.producers[i])
                b.emit(Stream.COMPUTE, Kind.COMPUTE, i, Phase.RECOMPUTE, reads=("fixed",) + lo.weights(i) + lo.acts_in(i),
                       allocs=(f"act:{i}",), workspace=forward_workspace(stages[i]))
        save = not dec[s].recomputed and g.chunks == 1
        reads = ("fixed",) + lo.weights(s) + lo.acts_in(s) + ((f"saved:{s}",) if save else ()) + \
            ((f"grad:{s}",) if g.grad_outputs else ())
        allocs = tuple(f"grad:{p}" for p in lo.producers[s] if stages[p].grad_outputs and stages.grad_maker(p) == s) + \
            ((f"g:{s}",) if dec[s].streamed else (lo.rgrads[s],)) + (("rgrad:shared",) if s == S - 1 and -1 in lo.rgrads else ())
        # a chunked stage's workspace is one chunk's forward and backward (its peak_bytes)
        lo.part_back(lo.producers[s])
        lo.cast(s)
        b.emit(Stream.COMPUTE, Kind.COMPUTE, s, Phase.BWD, reads=reads, allocs=allocs,
               workspace=chunk_workspace(stages, s) + backward_workspace(g) if g.chunks > 1
               else backward_workspace(g) + (0 if save else recompute_workspace(g)))
        if save:
            b.emit(Stream.COMPUTE, Kind.FREE, s, frees=(f"saved:{s}",))
        for p in lo.producers[s]:
            if stages[p].consumers[0] == s and lo.held_to(p) == s:
                b.emit(Stream.COMPUTE, Kind.FREE, p, frees=(f"act:{p}",))
        if g.consumers and lo.held_to(s) == s:  # outputs its autograd graph held until now
            b.emit(Stream.COMPUTE, Kind.FREE, s, frees=(f"act:{s}",))
        if g.grad_outputs:
            b.emit(Stream.COMPUTE, Kind.FREE, s, frees=(f"grad:{s}",))
        if dec[s].weights.cast_on_use:
            b.emit(Stream.COMPUTE, Kind.FREE, s, frees=(f"w:{s}",))
        lo.rule(s).after_backward(lo, s)
        if s + 1 < S and n > 1:
            lo.reduced(s + 1)
        elif s + 1 < S:
            lo.rule(s + 1).gradient_landed(lo, s + 1)
        lo.rule(s).backward_end(lo, s)
        if s + 2 < S:
            lo.rule(s + 2).two_later(lo, s + 2)
    b.t = win_start["tail"]
    if n > 1:
        return _sharded_tail(lo)
    lo.rule(0).gradient(lo, 0)
    lo.rule(0).gradient_landed(lo, 0)
    if stages.shared_params:
        b.emit(Stream.COMPUTE, Kind.OPT_STEP, -1, reads=("shared", "rgrad:shared"), device="gpu",
               workspace=shared_step_bytes(stages))
    kept = {k: name for k, name in lo.rgrads.items() if k not in lo.freed}
    if kept:  # with gradient clipping every resident step waits until here (NOTE: [Resident steps])
        b.emit(Stream.COMPUTE, Kind.FREE, min(kept), frees=tuple(kept.values()),
               workspace=deferred_step_bytes(stages, [not d.streamed for d in dec]))
    return Schedule(tuple(b.events), tuple(b.buffers.values()), plan.budget, hw.allocator_reserve_bytes)


def _sharded_tail(lo: Lowering) -> Schedule:
    """After backward with sharded state: stage 0's reduce-scatter and step, then the shared
    weights' (whose gradients every stage that reads them added to), each gathered once stepped."""
    stages, n, b = lo.stages, lo.n, lo.b
    lo.reduce(0)
    lo.reduced(0)
    if stages.shared_params:
        b.emit(Stream.COMM, Kind.REDUCE, -1, reads=("rgrad:shared",), allocs=("sg:shared",), moved=stages.shared_bytes,
               workspace=comm_workspace(stages.shared_bytes, stages.shared_numel, len(stages.shared_params), n))
        b.emit(Stream.COMPUTE, Kind.FREE, -1, frees=("rgrad:shared",))
        step = b.emit(Stream.COMPUTE, Kind.OPT_STEP, -1, reads=("shared", "sg:shared"), device="gpu",
                      workspace=piece(shared_step_bytes(stages), stages.shared_numel, len(stages.shared_params), n))
        lo.gather(-1, "shared", after=(step,))
    kept = tuple(f"sg:{s}" for s in sorted(lo.rgrads) if s >= 0) + (("sg:shared",) if stages.shared_params else ())
    if kept:  # the shards of resident gradients stay until the next step starts (NOTE: [Resident steps])
        b.emit(Stream.COMPUTE, Kind.FREE, min(lo.rgrads), frees=kept,
               workspace=sharded_deferred_bytes(stages, [not d.streamed for d in lo.plan.decisions], n))
    return Schedule(tuple(b.events), tuple(b.buffers.values()), lo.plan.budget, lo.hw.allocator_reserve_bytes)
