"""Pass `lower`: a `Plan` -> the step's events per stream, with waits, and its static buffers.

Needs: `Stages` and a `Plan` for them. Guarantees: events in an order that respects every
dependency (the CPU runtime replays them in this order); each buffer allocated by one event and freed
by a FREE event at its last use; the live buffers in each window are exactly those `solve` counted
there (NOTE: [The step model] in solver/solve.py), so `verify` can re-check the budget event by event.

    plan: stage 1 streamed         events: PREFETCH w:1 (h2d) ; COMPUTE 0 fwd ; COMPUTE 1 fwd
                                           (waits on the prefetch) ; FREE w:1 ; ...
"""

from __future__ import annotations

from lazytrain.hardware import Hardware
from lazytrain.ir.events import Buffer, Event, Kind, Phase, Stream
from lazytrain.ir.placement import Outputs, Tier
from lazytrain.ir.plan import Plan
from lazytrain.ir.schedule import Schedule
from lazytrain.ir.stages import Stages
from lazytrain.solver.footprint import (
    backward_step_bytes,
    backward_workspace,
    cast_s,
    chunk_workspace,
    cpu_step_s,
    disk_gpu_job_s,
    disk_step_s,
    disk_step_slot_bytes,
    gpu_step_s,
    deferred_step_bytes,
    fixed_bytes,
    forward_workspace,
    gpu_step_bytes,
    gpu_step_out_bytes,
    gpu_step_state_bytes,
    master_staging_bytes,
    recompute_workspace,
    resident_bytes,
    resident_grad_bytes,
    saving_workspace,
    shared_grad_bytes,
    shared_step_bytes,
    step_bytes,
    prefetches_from_master,
)
from lazytrain.solver.shards import (
    comm_s,
    comm_workspace,
    piece,
    resident_sharded_bytes,
    shard_grad_bytes,
    sharded_deferred_bytes,
    sharded_step_bytes,
    sharding,
)


class _Builder:
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
        if moved is None:
            moved = self.buffers[(allocs or reads or ("fixed",))[0]].bytes
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
        if kind in (Kind.REDUCE, Kind.GATHER):
            return comm_s(moved, hw, sharding(stages))
        if kind is Kind.OPT_STEP:
            if g is None:
                return gpu_step_s(stages.shared_numel, len(stages.shared_params), hw, stages.master_bytes)
            p = plan.decisions[stage]
            match p.kind:
                case "job":  # NOTE: [Disk-stepped stages]
                    return disk_gpu_job_s(g.param_bytes, g.param_numel, len(g.params), hw, stages.state_bytes,
                                          stages.master_bytes)
                case "host":
                    disk = disk_step_s(g.param_numel, hw) if p.step.states is Tier.DISK else 0.0  # NOTE: [Disk-resident states]
                    return cpu_step_s(g.param_bytes, g.param_numel, hw, stages.master_bytes) + disk
                case _:
                    return gpu_step_s(g.param_numel, len(g.params), hw, stages.master_bytes)
        return 0.0
    return duration


def lower(stages: Stages, plan: Plan, hw: Hardware) -> Schedule:
    S = len(stages)
    dec = plan.decisions
    b = _Builder()
    b.duration = _durations(stages, plan, hw)
    win_start, acc = {}, 0.0
    for label, _, secs in plan.windows:
        win_start[label] = acc
        acc += secs

    M = stages.master_bytes
    n = sharding(stages)  # NOTE: [Sharded state] in runtime/sharding.py
    from_master = [prefetches_from_master(stages, s, d) for s, d in enumerate(dec)]  # NOTE: [Weights from the master]
    shared = resident_bytes(stages.shared_bytes, stages.shared_numel, stages.state_bytes, M)
    b.buffer("fixed", "gpu", fixed_bytes(stages) - shared + hw.runtime_bytes, persistent=True)
    nshared = len(stages.shared_params)
    if n > 1:
        shared = resident_sharded_bytes(stages.shared_bytes, stages.shared_numel, nshared, stages.state_bytes, M, n)
    b.buffer("shared", "gpu", shared, persistent=True)
    # gradients of resident weights: made by their backward, kept until the next step starts (NOTE:
    # [Resident steps] in solver/footprint.py); the runtime's FREE of one is a no-op
    rgrads = {s: f"rgrad:{s}" for s, d in enumerate(dec) if not d.streamed}
    freed = {s for s in rgrads if s >= 0 and dec[s].step.frees_grads}  # NOTE: [Resident gradients freed at their step]
    if stages.shared_params:
        rgrads[-1] = "rgrad:shared"
        # sharded: the full gradients go at their reduce-scatter, the shard stays
        b.buffer("rgrad:shared", "gpu", stages.shared_bytes if n > 1 else shared_grad_bytes(stages))
        if n > 1:
            b.buffer("sg:shared", "gpu", shard_grad_bytes(stages.shared_bytes, stages.shared_numel, nshared, M, n))
    for s, g in enumerate(stages):
        P = len(g.params)
        if not dec[s].streamed:
            if n > 1:
                b.buffer(f"res:{s}", "gpu", resident_sharded_bytes(g.param_bytes, g.param_numel, P, stages.state_bytes, M, n),
                         persistent=True)
                b.buffer(rgrads[s], "gpu", g.param_bytes)
                b.buffer(f"sg:{s}", "gpu", shard_grad_bytes(g.param_bytes, g.param_numel, P, M, n))
            else:
                cast = g.param_bytes if dec[s].weights.cast_on_use else 0  # NOTE: [Resident weights cast on use] in solver/footprint.py
                b.buffer(f"res:{s}", "gpu", resident_bytes(g.param_bytes, g.param_numel, stages.state_bytes, M) - cast,
                         persistent=True)
                b.buffer(rgrads[s], "gpu", resident_grad_bytes(g.param_bytes, g.param_numel, M))
                if cast:
                    b.buffer(f"w:{s}", "gpu", cast)
        else:
            # NOTE: [Weights from the master] in solver/footprint.py: the slot stages the master's largest tensor
            b.buffer(f"w:{s}", "gpu", g.param_bytes + (master_staging_bytes(g) if from_master[s] else 0))
            b.buffer(f"g:{s}", "gpu", g.param_bytes)
            # a GPU step reads last step's gradient at this step's prefetch: it outlives the step
            # (a step in backward reads it on the device: NOTE: [Backward steps] in solver/step_model.py)
            kind = dec[s].kind
            if kind != "backward":
                b.buffer(f"host:grad:{s}", "host", piece(g.param_bytes, g.param_numel, P, n), persistent=kind == "prefetch")
            if n > 1:
                b.buffer(f"sg:{s}", "gpu", piece(g.param_bytes, g.param_numel, P, n))
            match kind:
                case "backward":  # NOTE: [Backward step twins] in solver/footprint.py
                    b.buffer(f"opt:{s}", "gpu", backward_step_bytes(g.param_bytes, g.param_numel, stages.state_bytes, M,
                                                                    g.largest_numel))
                case "prefetch":
                    b.buffer(f"opt:{s}", "gpu", piece(gpu_step_bytes(g.param_bytes, g.param_numel, stages.state_bytes, M,
                                                                     g.largest_numel), g.param_numel, P, n))
        b.buffer(f"act:{s}", "gpu", g.out_bytes if g.consumers else 0)
        b.buffer(f"saved:{s}", "gpu", g.saved_bytes)
        b.buffer(f"grad:{s}", "gpu", g.grad_out_bytes)
        if dec[s].outputs.offloaded:
            b.buffer(f"host:act:{s}", "host", g.out_bytes)

    slot = disk_step_slot_bytes(stages, dec)  # NOTE: [Disk-stepped stages] in solver/disk_model.py
    if slot:
        b.buffer("dstep", "gpu", slot, persistent=True)
    producers = {s: g.producers for s, g in enumerate(stages)}

    def held_to(p: int) -> int:
        """The backward after which stage p's outputs go: its first reader's, or its own when its
        autograd graph holds them (a saving stage)."""
        saving = not dec[p].recomputed and stages[p].chunks == 1
        return p if saving else stages[p].consumers[0]

    def weights(s: int) -> tuple[str, ...]:
        """The buffers stage `s`'s compute reads its weights from (a slot cast on use beside the home)."""
        if dec[s].streamed:
            return (f"w:{s}",)
        return (f"res:{s}",) + ((f"w:{s}",) if dec[s].weights.cast_on_use else ())

    def cast(s: int):
        """NOTE: [Resident weights cast on use] in solver/footprint.py: the weights from the master, before a use."""
        if dec[s].weights.cast_on_use:
            b.emit(Stream.COMPUTE, Kind.PREFETCH, s, allocs=(f"w:{s}",), moved=0)
    acts_in = lambda s: tuple(f"act:{p}" for p in producers[s])  # noqa: E731

    # A GPU-stepped streamed stage applies last step's update at its forward prefetch
    # (NOTE: [GPU-stepped streamed stages] in solver/solve.py).
    stepped: dict[int, int] = {}  # stage -> its OPT_STEP event

    def step_out_bytes(s: int) -> int:
        """What a GPU step of stage `s` writes back (and a step in backward fetches): weights, master, states."""
        return gpu_step_out_bytes(stages[s].param_bytes, stages[s].param_numel, stages.state_bytes, stages.master_bytes)

    def weights_bytes(s: int) -> int:
        """What a plain prefetch of stage `s` brings, and its step's OFFLOAD of `w:S` sends back: the
        weights, or the fp32 master they are cast from (NOTE: [Weights from the master] in solver/footprint.py)."""
        g = stages[s]
        return stages.master_bytes * g.param_numel if from_master[s] else g.param_bytes

    def states_out(s: int) -> int:
        """What a GPU step of stage `s` sends back beside its `w:S` OFFLOAD: master and states (a
        rank's share), or the states alone where that OFFLOAD sent the master."""
        g = stages[s]
        return share(step_out_bytes(s) - g.param_bytes, s) - (weights_bytes(s) if from_master[s] else 0)

    def share(nbytes: int, s: int) -> int:
        """A rank's share of stage `s`'s `nbytes` (all of it without sharding)."""
        return piece(nbytes, stages[s].param_numel, len(stages[s].params), n)

    def gather(s: int, buf: str, after=()):
        """All-gather of stage `s`'s (or the shared, -1) updated weights from every rank's shard into `buf`."""
        nbytes, numel, P = (stages.shared_bytes, stages.shared_numel, nshared) if s < 0 else (
            stages[s].param_bytes, stages[s].param_numel, len(stages[s].params))
        b.emit(Stream.COMM, Kind.GATHER, s, writes=(buf,), after=after, moved=nbytes,
               workspace=comm_workspace(nbytes, numel, P, n))

    def prefetch(s: int):
        g = stages[s]
        if dec[s].kind != "prefetch":
            # sharded: only this rank's shard of the new weights comes over; the rest from the other ranks
            b.emit(Stream.H2D, Kind.PREFETCH, s, allocs=(f"w:{s}",), moved=share(weights_bytes(s), s))
            if n > 1:
                gather(s, f"w:{s}")
            return
        b.emit(Stream.H2D, Kind.PREFETCH, s, reads=(f"host:grad:{s}",), allocs=(f"opt:{s}", f"w:{s}"),
               moved=share(gpu_step_state_bytes(g.param_numel, stages.state_bytes, stages.master_bytes) + g.param_bytes, s))
        b.emit(Stream.H2D, Kind.FREE, s, frees=(f"host:grad:{s}",))

    def gpu_step(s: int):
        if dec[s].kind == "prefetch":
            stepped[s] = b.emit(Stream.COMPUTE, Kind.OPT_STEP, s, reads=(f"opt:{s}", f"w:{s}"), device="gpu")
            if n > 1:
                gather(s, f"w:{s}", after=(stepped[s],))

    def step_out(s: int):
        if dec[s].kind == "prefetch":
            # the new weights first: the slot's FREE after this forward waits for this copy only
            b.emit(Stream.D2H, Kind.OFFLOAD, s, reads=(f"w:{s}",), after=(stepped[s],), moved=weights_bytes(s))
            b.emit(Stream.D2H, Kind.OFFLOAD, s, reads=(f"opt:{s}",), after=(stepped[s],), moved=states_out(s))
        elif dec[s].streamed and n > 1:  # the gathered weights back to the host copy the backward prefetch reads
            b.emit(Stream.D2H, Kind.OFFLOAD, s, reads=(f"w:{s}",))

    def host_step(s: int):
        """A streamed stage's step on the host worker once its gradient has landed: AdamW on the CPU,
        or a disk-stepped stage's job (NOTE: [Disk-stepped stages] in solver/disk_model.py)."""
        match dec[s].kind:
            case "host":
                b.emit(Stream.CPU, Kind.OPT_STEP, s, reads=(f"host:grad:{s}",), device="cpu")
            case "job":
                b.emit(Stream.CPU, Kind.OPT_STEP, s, reads=(f"host:grad:{s}",), device="disk")

    def reduce(k: int):
        """Reduce-scatter of stage `k`'s gradients; a streamed stage's shard goes to the host."""
        g = stages[k]
        b.emit(Stream.COMM, Kind.REDUCE, k, reads=(f"g:{k}" if dec[k].streamed else rgrads[k],), allocs=(f"sg:{k}",),
               moved=g.param_bytes, workspace=comm_workspace(g.param_bytes, g.param_numel, len(g.params), n))
        if dec[k].streamed:
            b.emit(Stream.D2H, Kind.OFFLOAD, k, reads=(f"sg:{k}",), allocs=(f"host:grad:{k}",))

    def reduced(k: int):
        """After the backward that overlapped stage `k`'s reduce-scatter: its full gradients go, and
        its shard is stepped (a resident stage's new weights then gathered)."""
        if dec[k].streamed:
            b.emit(Stream.COMPUTE, Kind.FREE, k, frees=(f"g:{k}",))
            b.emit(Stream.COMPUTE, Kind.FREE, k, frees=(f"sg:{k}",))
            if dec[k].kind == "host":
                b.emit(Stream.CPU, Kind.OPT_STEP, k, reads=(f"host:grad:{k}",), device="cpu")
            return
        b.emit(Stream.COMPUTE, Kind.FREE, k, frees=(rgrads[k],))
        step = b.emit(Stream.COMPUTE, Kind.OPT_STEP, k, reads=(f"res:{k}", f"sg:{k}"), device="gpu",
                      workspace=sharded_step_bytes(stages, k, n))
        gather(k, f"res:{k}", after=(step,))

    # ---- forward ----------------------------------------------------------------------------
    b.t = win_start["pre"]
    if dec[0].streamed:
        prefetch(0)
        gpu_step(0)
    for s, g in enumerate(stages):
        b.t = win_start[f"F{s}"]
        if s + 1 < S and dec[s + 1].streamed and dec[s + 1].weights.lookahead == 1:
            prefetch(s + 1)
        if s + 2 < S and dec[s + 2].weights.lookahead == 2:
            prefetch(s + 2)
        if s > 0:
            # Issued after this window's prefetches: a prefetch's slot waits for the compute work
            # issued before it (NOTE: [Slots] in runtime/store.py), so a step issued first and run
            # in compute order would hold up every fetch. (The CUDA runtime runs it beside compute,
            # NOTE: [Optimizer stream] in runtime/stepping.py; the order keeps other runtimes right.)
            gpu_step(s)
        step_out(s)
        for p in producers[s]:
            if dec[p].outputs.offloaded and s == p + 1:
                b.emit(Stream.D2H, Kind.OFFLOAD, p, reads=(f"act:{p}",), allocs=(f"host:act:{p}",))
        save = not dec[s].recomputed and g.chunks == 1
        allocs = ((f"act:{s}",) if g.consumers else ()) + ((f"saved:{s}",) if save else ())
        # a saving forward holds its operators' own workspace beside what it saves (NOTE: [Operator workspace])
        cast(s)
        b.emit(Stream.COMPUTE, Kind.COMPUTE, s, Phase.FWD, reads=("fixed",) + weights(s) + acts_in(s),
               allocs=allocs, workspace=saving_workspace(g) if save else forward_workspace(g))
        if dec[s].streamed and s < S - 1 or dec[s].weights.cast_on_use:
            b.emit(Stream.COMPUTE, Kind.FREE, s, frees=(f"w:{s}",))
        if dec[s].kind == "prefetch":  # after this forward: compute waits here for the write-back, if late
            b.emit(Stream.COMPUTE, Kind.FREE, s, frees=(f"opt:{s}",))
        for p in producers[s]:
            mode = dec[p].outputs
            if (mode.offloaded and stages[p].consumers[-1] == s) or (mode is Outputs.DROP and s == p + 1):
                b.emit(Stream.COMPUTE, Kind.FREE, p, frees=(f"act:{p}",))

    # ---- backward ---------------------------------------------------------------------------
    for s in reversed(range(S)):
        g = stages[s]
        b.t = win_start[f"B{s}"]
        if s - 1 >= 0 and dec[s - 1].kind == "backward":  # NOTE: [Backward steps]: master and states beside the weights
            b.emit(Stream.H2D, Kind.PREFETCH, s - 1, allocs=(f"opt:{s - 1}", f"w:{s - 1}"),
                   moved=step_out_bytes(s - 1) - stages[s - 1].param_bytes + weights_bytes(s - 1))
        elif s - 1 >= 0 and dec[s - 1].streamed:
            b.emit(Stream.H2D, Kind.PREFETCH, s - 1, allocs=(f"w:{s - 1}",), moved=weights_bytes(s - 1))
        for p in range(S):
            if dec[p].outputs.offloaded and stages[p].consumers[-1] + 1 == s:
                b.emit(Stream.H2D, Kind.RELOAD, p, reads=(f"host:act:{p}",), allocs=(f"act:{p}",))
        if s + 1 < S and n > 1:  # NOTE: [Sharded state] in runtime/sharding.py
            reduce(s + 1)
        elif s + 1 < S and dec[s + 1].kind == "backward":  # beside this backward: the last one's stage steps, goes back
            k = s + 1
            stepped[k] = b.emit(Stream.COMPUTE, Kind.OPT_STEP, k, reads=(f"opt:{k}", f"w:{k}", f"g:{k}"), device="gpu")
            b.emit(Stream.D2H, Kind.OFFLOAD, k, reads=(f"w:{k}",), after=(stepped[k],), moved=weights_bytes(k))
            b.emit(Stream.D2H, Kind.OFFLOAD, k, reads=(f"opt:{k}",), after=(stepped[k],), moved=states_out(k))
        elif s + 1 < S and dec[s + 1].streamed:
            b.emit(Stream.D2H, Kind.OFFLOAD, s + 1, reads=(f"g:{s + 1}",), allocs=(f"host:grad:{s + 1}",))
        if s >= 1 and dec[s - 1].outputs is Outputs.DROP and dec[s].outputs is not Outputs.DROP:
            j = s - 1
            while j - 1 >= 0 and dec[j - 1].outputs is Outputs.DROP:
                j -= 1
            for i in range(j, s):  # regenerate the dropped segment bottom-up
                b.emit(Stream.COMPUTE, Kind.COMPUTE, i, Phase.RECOMPUTE, reads=("fixed",) + weights(i) + acts_in(i),
                       allocs=(f"act:{i}",), workspace=forward_workspace(stages[i]))
        save = not dec[s].recomputed and g.chunks == 1
        reads = ("fixed",) + weights(s) + acts_in(s) + ((f"saved:{s}",) if save else ()) + \
            ((f"grad:{s}",) if g.grad_outputs else ())
        allocs = tuple(f"grad:{p}" for p in producers[s] if stages[p].grad_outputs and stages.grad_maker(p) == s) + \
            ((f"g:{s}",) if dec[s].streamed else (rgrads[s],)) + (("rgrad:shared",) if s == S - 1 and -1 in rgrads else ())
        # a chunked stage's workspace is one chunk's forward and backward (its peak_bytes)
        cast(s)
        b.emit(Stream.COMPUTE, Kind.COMPUTE, s, Phase.BWD, reads=reads, allocs=allocs,
               workspace=chunk_workspace(stages, s) + backward_workspace(g) if g.chunks > 1
               else backward_workspace(g) + (0 if save else recompute_workspace(g)))
        if save:
            b.emit(Stream.COMPUTE, Kind.FREE, s, frees=(f"saved:{s}",))
        for p in producers[s]:
            if stages[p].consumers[0] == s and held_to(p) == s:
                b.emit(Stream.COMPUTE, Kind.FREE, p, frees=(f"act:{p}",))
        if g.consumers and held_to(s) == s:  # outputs its autograd graph held until now
            b.emit(Stream.COMPUTE, Kind.FREE, s, frees=(f"act:{s}",))
        if g.grad_outputs:
            b.emit(Stream.COMPUTE, Kind.FREE, s, frees=(f"grad:{s}",))
        # a backward-stepped slot goes after its write-back
        if dec[s].streamed and dec[s].kind != "backward" or dec[s].weights.cast_on_use:
            b.emit(Stream.COMPUTE, Kind.FREE, s, frees=(f"w:{s}",))
        if s + 1 < S and n > 1:
            reduced(s + 1)
        elif s + 1 < S and dec[s + 1].kind == "backward":
            pass  # freed after the next backward (NOTE: [Backward steps])
        elif s + 1 < S and dec[s + 1].streamed:
            b.emit(Stream.COMPUTE, Kind.FREE, s + 1, frees=(f"g:{s + 1}",))
            host_step(s + 1)
        if not dec[s].streamed and n == 1:
            b.emit(Stream.COMPUTE, Kind.OPT_STEP, s, reads=(f"res:{s}", rgrads[s]), device="gpu",
                   workspace=step_bytes(stages, s))
        if s + 2 < S and s + 2 in freed:  # NOTE: [Resident gradients freed at their step] in solver/footprint.py
            b.emit(Stream.COMPUTE, Kind.FREE, s + 2, frees=(rgrads[s + 2],))
        if s + 2 < S and dec[s + 2].kind == "backward":  # stepped and written back beside two backwards
            for buf in (f"g:{s + 2}", f"w:{s + 2}", f"opt:{s + 2}"):
                b.emit(Stream.COMPUTE, Kind.FREE, s + 2, frees=(buf,))
    b.t = win_start["tail"]
    if n > 1:
        return _sharded_tail(b, stages, plan, hw, reduce, reduced, gather, rgrads, n)
    if dec[0].streamed:
        b.emit(Stream.D2H, Kind.OFFLOAD, 0, reads=("g:0",), allocs=("host:grad:0",))
        b.emit(Stream.COMPUTE, Kind.FREE, 0, frees=("g:0",))
        host_step(0)
    if stages.shared_params:
        b.emit(Stream.COMPUTE, Kind.OPT_STEP, -1, reads=("shared", "rgrad:shared"), device="gpu",
               workspace=shared_step_bytes(stages))
    kept = {k: name for k, name in rgrads.items() if k not in freed}
    if kept:  # with gradient clipping every resident step waits until here (NOTE: [Resident steps])
        b.emit(Stream.COMPUTE, Kind.FREE, min(kept), frees=tuple(kept.values()),
               workspace=deferred_step_bytes(stages, [not d.streamed for d in dec]))
    return Schedule(tuple(b.events), tuple(b.buffers.values()), plan.budget, hw.allocator_reserve_bytes)


def _sharded_tail(b: _Builder, stages: Stages, plan: Plan, hw: Hardware, reduce, reduced, gather, rgrads, n: int) -> Schedule:
    """After backward with sharded state: stage 0's reduce-scatter and step, then the shared
    weights' (whose gradients every stage that reads them added to), each gathered once stepped."""
    reduce(0)
    reduced(0)
    if stages.shared_params:
        b.emit(Stream.COMM, Kind.REDUCE, -1, reads=("rgrad:shared",), allocs=("sg:shared",), moved=stages.shared_bytes,
               workspace=comm_workspace(stages.shared_bytes, stages.shared_numel, len(stages.shared_params), n))
        b.emit(Stream.COMPUTE, Kind.FREE, -1, frees=("rgrad:shared",))
        step = b.emit(Stream.COMPUTE, Kind.OPT_STEP, -1, reads=("shared", "sg:shared"), device="gpu",
                      workspace=piece(shared_step_bytes(stages), stages.shared_numel, len(stages.shared_params), n))
        gather(-1, "shared", after=(step,))
    kept = tuple(f"sg:{s}" for s in sorted(rgrads) if s >= 0) + (("sg:shared",) if stages.shared_params else ())
    if kept:  # the shards of resident gradients stay until the next step starts (NOTE: [Resident steps])
        b.emit(Stream.COMPUTE, Kind.FREE, min(rgrads), frees=kept,
               workspace=sharded_deferred_bytes(stages, [not d.streamed for d in plan.decisions], n))
    return Schedule(tuple(b.events), tuple(b.buffers.values()), plan.budget, hw.allocator_reserve_bytes)

