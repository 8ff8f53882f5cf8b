"""The step model of pass `solve` (NOTE: [The step model] in formulation.py): per-window memory, compute
capacity, transfer volumes, host work and collectives of one training step, as linear expressions
over the MIP's decision variables (`formulation._vars`), which `formulation._build` prices and bounds.

The walk over the stages adds what every placement shares: compute, internals, outputs, a streamed
stage's weight slot and its traffic, and the sharded paths. Each optimizer-step kind's own terms
come from its rule (solver/steps/), called for every stage with the expression that is 1 where the
stage takes that kind.
"""

from __future__ import annotations

import mip

from lazytrain.hardware import Hardware
from lazytrain.ir.stages import Stage, Stages
from lazytrain.solver.backlog import backlog
from lazytrain.solver import boundary
from lazytrain.solver.disk_model import disk_tier
from lazytrain.solver.footprint import (
    CPU_STATE_BYTES,
    Layout,
    deferred_step_bytes,
    disk_available,
    fixed_bytes,
    gpu_step_s,
    host_bytes_streamed,
    master_staging_bytes,
    resident_bytes,
    shared_grad_bytes,
    step_bytes,
    weights_from_master,
)
from lazytrain.solver.shards import (
    allreduce_s,
    comm_s,
    comm_workspace,
    gathers_weights,
    host_shard_bytes,
    piece,
    resident_sharded_bytes,
    shard_grad_bytes,
    sharded_deferred_bytes,
    sharded_step_bytes,
    sharded_tail,
    shared_step_s,
    sharding,
)
from lazytrain.solver.steps import RULES, StageTerms
from lazytrain.solver.workspace import (
    backward_workspace,
    chunk_workspace,
    forward_workspace,
    recompute_workspace,
    saving_workspace,
)


class StepModel:
    """The step model: per-window memory, compute capacity and transfer volumes as linear expressions."""

    def __init__(self, stages: Stages, hw: Hardware, vars_: dict, m: mip.Model):
        self.st, self.hw, self.m = stages, hw, m
        self.floors: list = []  # variables held at their least by the objective (NOTE: [Floor variables])
        S = len(stages)
        self.L = L = Layout(S)
        self.v = vars_
        # NOTE: [MIP scaling] CBC misjudges optimality when the objective is ~1e-3 and byte counts
        # ~1e10 share rows with it; bytes are counted in `unit` (about a thousandth of the model)
        # and time in `unit_s` (the step's compute), so coefficients stay near 1. Variables that
        # hold bytes (R, the offload parts, twins) hold them in `unit`s too: HiGHS warns of, and
        # slows on, rows whose coefficients span more than about 1e9.
        M = stages.master_bytes
        self.unit = byte_unit(stages)
        self.unit_s = max(1e-12, sum(g.fwd_s + g.bwd_s for g in stages))
        T = 2 * S
        sig = vars_["stream"]
        n = self.n = sharding(stages)  # NOTE: [Sharded state] in runtime/sharding.py
        self.zero3 = gathers_weights(stages)  # NOTE: [Sharded host weights] in runtime/host_weights.py
        steps = self._deferred_steps(sig)
        fixed = fixed_bytes(stages) + hw.runtime_bytes
        if n > 1:  # the shared weights' states and master are sharded too
            fixed += resident_sharded_bytes(stages.shared_bytes, stages.shared_numel, len(stages.shared_params),
                                            stages.state_bytes, M, n) - resident_bytes(
                stages.shared_bytes, stages.shared_numel, stages.state_bytes, M)
        self.mem = [fixed for _ in range(T)]
        for t in range(S, T):  # shared (tied) weights' gradients, from the first backward on
            self.mem[t] = self.mem[t] + (stages.shared_bytes if n > 1 else shared_grad_bytes(stages))
        # after backward: resident weights and their gradients, and the steps clipping defers (NOTE: [Resident steps])
        self.tail = sharded_tail(stages, hw, [1 - x for x in sig], steps, n) if n > 1 else \
            fixed_bytes(stages) + hw.runtime_bytes + shared_grad_bytes(stages) + steps
        self.h2d = [0.0] * (T + 2)  # index T is `pre`, T+1 is `tail`
        self.comm = [0.0] * (T + 2)  # seconds of collectives on the ranks' link (NOTE: [Link bandwidth])
        self.lag = [0.0] * (T + 2)  # seconds of device work that must follow a window's H2D before its end
        self.d2h = [0.0] * (T + 2)
        self.dlag = [0.0] * (T + 2)  # seconds of device work that must follow a window's D2H before its end
        self.cpu = [0.0] * (T + 2)
        self.released = [0.0] * (T + 2)  # host step seconds that may start in a window (NOTE: [Host step backlog] in backlog.py)
        self.due = [0.0] * (T + 2)  # host step seconds that must be done by a window's end (exact clipping)
        self.exact = stages.clipping == "exact"
        self.PRE, self.TAIL = PRE, TAIL = T, T + 1
        self.cap = [0.0] * (T + 2)
        self.compute = sum(s.fwd_s + s.bwd_s for s in stages)
        self.recompute = 0.0
        # device steps: `serial` those in series with compute; the rest run on the optimizer stream
        # beside backward (NOTE: [Device steps beside compute])
        self.on_stream = n == 1 and not self.exact and hw.gpu_step_pace > 0
        # what compute loses of a step beside it, at the size of the model's typical block (its blocks'
        # median: the layers, not the embedding or the head)
        self.lost = hw.step_lost(sorted(g.param_numel for g in stages)[len(stages) // 2])
        self.stepped = [0.0] * (T + 2)  # device step seconds released to the optimizer stream in a window
        self.step_due = [0.0] * (T + 2)  # of them, what must be done by a window's end (resident gradients freed)
        shared_step = shared_step_s(stages, hw)
        if self.on_stream:
            self.stepped[TAIL] += shared_step
        self.serial = 0.0 if self.on_stream else shared_step
        if stages.shared_numel:  # the shared weights' reduce-scatter and all-gather after backward
            self.comm[TAIL] += comm_s(stages.shared_bytes, hw, n)
            self.spread(self.comm, [TAIL, PRE], comm_s(stages.shared_bytes, hw, n), "gather_shared")
        self.disk_ok = stages.disk and n == 1 and disk_available(hw)
        # per stage, with the disk tier: (window released, window due by, host worker seconds, of
        # them a disk-stepped job's)
        self.host_jobs: list[tuple[int, int, object, object]] = []
        # of the host worker's jobs, the disk's seconds: released and due with their jobs (NOTE: [One disk] in disk_model.py)
        self.job_disk_released, self.job_disk_due = [0.0] * (T + 2), [0.0] * (T + 2)
        terms = []
        for s, g in enumerate(stages):
            st = self._stage(s, g)
            kinds = [(rule, rule.indicator(vars_, s)) for rule in RULES.values()]  # x: 1 where s takes rule's kind
            for rule, x in kinds:  # a resident stage's weights, gradients and states
                rule.home(self, st, x)
            if n > 1:
                self._sharded(s, g, self.mem, self.comm, self.h2d, self.d2h, sig, vars_["gstep"])
            self._weight_slot(st)
            for rule, x in kinds:  # the host worker's seconds: host steps and jobs
                rule.host_work(self, st, x)
            self._host_worker(st)
            for rule, x in kinds:  # a device step's states, buffers and seconds
                rule.transfers(self, st, x)
            self._internals(s, g)
            self._outputs(s, g)
            terms.append(st)
        self._host_steps()
        self._optimizer_stream()
        # recomputed dropped outputs live at B(c): R[c] = drop[c-1] * (out[c-1] + R[c-1]), in `unit` bytes
        R = vars_["R"]
        self.floors.extend(R)
        PK = max((s.peak_bytes for s in stages), default=0)
        for c in range(1, S):
            self.mem[L.bw(c)] = self.mem[L.bw(c)] + R[c] * self.unit + PK * vars_["drop"][c - 1]
        for rule in RULES.values():
            rule.tail_bytes(self)
        self.host = self._host_memory(terms)
        disk_tier(self, self.disk_ok, TAIL)  # the offload file: its bytes, the host they free, the disk's seconds
        for rule in RULES.values():
            rule.host_buffers(self)

    def _stage(self, s: int, g: Stage) -> StageTerms:
        """The stage's compute (and a replicated all-reduce's), and the facts the rules read."""
        stages, hw, L, n, M = self.st, self.hw, self.L, self.n, self.st.master_bytes
        rec, drop = self.v["recompute"][s], self.v["drop"][s]
        chunked = g.chunks > 1
        P = len(g.params)
        self.cap[L.fw(s)] += 0.0 if chunked else g.fwd_s
        self.cap[L.bw(s)] += g.bwd_s + (g.fwd_s if chunked else g.remat_s * rec)
        self.recompute = self.recompute + g.remat_s * rec + g.fwd_s * drop  # NOTE: [Skipped recompute]
        if stages.world_size > 1 and n == 1:  # NOTE: [Replicated all-reduce]
            reduce_s = allreduce_s(g.param_bytes + (stages.shared_bytes if s == 0 else 0), hw, stages.world_size)
            self.cap[L.bw(s)] += reduce_s
            self.compute += reduce_s
        numel = piece(g.param_numel, g.param_numel, P, n)
        # NOTE: [Weights from the master] in footprint.py: a GPU-stepped stage's slot stages its
        # master, plain prefetches bring the master, and the host keeps no compute-dtype copy
        mixed = weights_from_master(stages, s)  # if stepped on the device (gstep, dstep)
        copy, staging = (g.param_bytes, master_staging_bytes(g)) if mixed else (0, 0)
        return StageTerms(s, g, numel, gpu_step_s(numel, P, hw, M, stages.state_bytes), copy, staging,
                          M * g.param_numel - g.param_bytes if mixed else 0,
                          L.bw(s - 2) if s >= 2 and not self.exact else self.TAIL,
                          (self.TAIL, self.PRE)[s] if s < 2 else L.fw(s - 2))

    def _weight_slot(self, st: StageTerms) -> None:
        """A streamed stage's weight slot, its prefetches (sharded: the forward prefetch brings this
        rank's shard) and its gradient's offload (sharded: as one shard). A stage stepped on the
        device (`gstep + dstep`) stages its master in the slot, and a plain prefetch of it brings the
        master (a forward one: not a step at the prefetch's, whose rule adds its states), unless the
        master is on disk (`mdisk`)."""
        s, g, L, v = st.s, st.g, self.L, self.v
        sig, gst, dst, bst, mdk = v["stream"][s], v["gstep"][s], v["dstep"][s], v["bstep"][s], v["mdisk"][s]
        for t in L.weight_windows(s):
            self.mem[t] = self.mem[t] + g.param_bytes * sig + st.staging * (gst + dst - mdk)
        for t in (L.bw(s), L.bw(s - 1) if s > 0 else None):
            if t is not None:
                self.mem[t] = self.mem[t] + g.param_bytes * sig + st.staging * (gst + dst - mdk)
        P, n = len(g.params), self.n
        shard = piece(g.param_bytes, g.param_numel, P, n)
        self.h2d[L.fw(s - 1) if s > 0 else self.PRE] += shard * sig + st.extra * (bst + dst - mdk)
        if s < len(self.st) - 1:  # the backward prefetch: the whole weights, or a shard to gather
            self.h2d[L.bw(s + 1)] += (shard if self.zero3 else g.param_bytes) * sig + st.extra * (gst + dst - mdk)
        self.d2h[L.bw(s - 1) if s > 0 else self.TAIL] += shard * sig

    def _host_worker(self, st: StageTerms) -> None:
        """The host worker's seconds the rules set on `st`, released once the stage's gradient has
        landed, each due by its deadline (NOTE: [Host step deadlines] in runtime/stepping.py)."""
        TAIL = self.TAIL
        if self.disk_ok:
            self.job_disk_released[st.release] += st.host_disk_s + st.job_disk_s
            self.job_disk_due[st.prefetched] += st.job_disk_s
            self.job_disk_due[st.prefetched if self.exact else TAIL] += st.host_disk_s
            # NOTE: [Jobs due in release order's reverse] in backlog.py
            self.host_jobs.append((st.release, st.prefetched, st.host_s + st.job_s, st.job_s))
        self.released[st.release] += st.host_s + st.job_s
        self.due[st.prefetched if self.exact else TAIL] += st.host_s
        self.due[st.prefetched] += st.job_s

    def _internals(self, s: int, g: Stage) -> None:
        """Saved from F(s) to B(s), or recomputed at B(s); plus backward's workspace."""
        L, mem, rec = self.L, self.mem, self.v["recompute"][s]
        for t in range(L.fw(s), L.bw(s) + 1):
            mem[t] = mem[t] + g.saved_bytes * (1 - rec)
        mem[L.fw(s)] = mem[L.fw(s)] + forward_workspace(g) * rec + saving_workspace(g) * (1 - rec)
        mem[L.bw(s)] = mem[L.bw(s)] + backward_workspace(g) + recompute_workspace(g) * rec
        if g.chunks > 1:  # one chunk's forward and backward
            mem[L.bw(s)] = mem[L.bw(s)] + chunk_workspace(self.st, s)

    def _outputs(self, s: int, g: Stage) -> None:
        """Output activations: kept, offloaded or dropped, and the gradient of them."""
        if not g.consumers:
            return
        L, mem, S = self.L, self.mem, len(self.st)
        rec, off, drop = self.v["recompute"][s], self.v["off"][s], self.v["drop"][s]
        cmin, cmax = g.consumers[0], g.consumers[-1]
        keep = 1 - off - drop
        for t in range(L.fw(s), L.bw(cmin) + 1):
            mem[t] = mem[t] + g.out_bytes * keep
        # a saving stage's autograd graph holds its outputs until its own backward
        # (it then keeps them: `_vars`), when its last reader came before
        for t in range(L.bw(cmin) + 1, L.bw(s) + 1):
            mem[t] = mem[t] + g.out_bytes * (1 - rec)
        for t in list(range(L.fw(s), L.fw(cmax) + 1)) + list(range(L.bw(cmax + 1), L.bw(cmin) + 1)) if cmax < S - 1 else []:
            mem[t] = mem[t] + g.out_bytes * off
        for t in (L.fw(s), L.fw(s + 1)):
            mem[t] = mem[t] + g.out_bytes * drop
        for t in range(L.bw(self.st.grad_maker(s)), L.bw(s) + 1):
            mem[t] = mem[t] + g.grad_out_bytes
        if cmax < S - 1:
            moved = boundary.moved_out(self.v, s, g)
            self.spread(self.d2h, [L.fw(w) for w in range(s + 1, cmax + 1)], moved, f"off{s}")
            self.h2d[L.bw(cmax + 1)] += moved
            boundary.kept_part(self, s, g, cmax)  # NOTE: [Boundary tiles] in boundary.py

    def _host_steps(self) -> None:
        """The host worker's seconds per window: its backlog over the windows its jobs may run in."""
        # NOTE: [Host step deadlines] in runtime/stepping.py's [Gradient clipping]: unclipped, host
        # steps end by the step's end (the runtime waits for them there); with exact clipping they
        # start after backward and run on into the next step's forward, each done before its prefetch;
        # disk-stepped stages' jobs may always do so (NOTE: [Disk-stepped stages] in disk_model.py)
        L, S, PRE, TAIL = self.L, len(self.st), self.PRE, self.TAIL
        into_forward = [PRE] + [L.fw(j) for j in range(S - 2)]
        self.hosted = [TAIL] + into_forward if self.exact else \
            list(range(S, 2 * S)) + [TAIL] + (into_forward if self.disk_ok else [])
        due = self.due if self.exact or self.disk_ok else None
        for w, done in backlog(self.m, self.released, self.hosted, self.unit_s, due).items():
            self.cpu[w] = self.cpu[w] + done

    def _optimizer_stream(self) -> None:
        """`beside`: seconds a window runs longer for the device steps beside or after it."""
        # NOTE: [Device steps beside compute] in hardware/__init__.py: the optimizer stream runs its
        # steps in the order released, at `gpu_step_pace` beside compute, and finishes after backward
        # (the next forward's first stage waits for the last step); compute loses `lost` (`Hardware.step_lost`) of
        # what runs beside it, and what is left after backward runs alone
        L, S, TAIL, hw = self.L, len(self.st), self.TAIL, self.hw
        self.beside = [0.0] * (2 * S + 2)
        if not self.on_stream:
            return
        windows = [L.bw(w) for w in range(S - 2, -1, -1)] + [TAIL]
        for w, done in backlog(self.m, self.stepped, windows, self.unit_s, self.step_due).items():
            if w == TAIL:
                self.beside[w] = done
            else:
                self.m += done * (1.0 / self.unit_s) <= self.cap[w] * (hw.gpu_step_pace / self.unit_s)
                self.beside[w] = done * self.lost

    def _host_memory(self, terms: list[StageTerms]):
        """Host bytes: masters, streamed stages' host copies and states, offloaded outputs."""
        stages, v, M = self.st, self.v, self.st.master_bytes
        sig, gst, dst, mdk = v["stream"], v["gstep"], v["dstep"], v["mdisk"]
        if self.n > 1:  # the model's parameters hold the full weights in the compute dtype; the rest is shards
            n = self.n
            # NOTE: [Sharded host weights] in runtime/host_weights.py: a streamed stage's, a shard
            whole = sum(g.param_bytes - sig[s] * (g.param_bytes - piece(g.param_bytes, g.param_numel, len(g.params), n))
                        if self.zero3 else g.param_bytes for s, g in enumerate(stages))
            return whole + stages.shared_bytes + sum(
                sig[s] * host_shard_bytes(g.param_bytes, g.param_numel, len(g.params), stages.state_bytes, M, n)
                - gst[s] * piece(M * g.param_numel, g.param_numel, len(g.params), n) + boundary.moved_out(v, s, g)
                + (sig[s] - gst[s]) * piece((CPU_STATE_BYTES - stages.state_bytes) * g.param_numel, g.param_numel,
                                            len(g.params), n)
                for s, g in enumerate(stages))
        placed = self.hw.device == "cuda"  # NOTE: [Resident masters on the device]
        return sum(M * g.param_numel * (sig[s] if placed else 1) for s, g in enumerate(stages)) + sum(
            self._stage_host(st, sig[st.s], gst[st.s] + dst[st.s], boundary.moved_out(v, st.s, st.g), mdk[st.s]) for st in terms)

    def _stage_host(self, st: StageTerms, sig, device, offloaded, mdk):
        """A stage's host bytes, without sharded state: a streamed stage's; a stage stepped on the
        device (`device`: gstep + dstep) keeps no fp32 master there, nor the compute-dtype copy where
        its prefetches read the master; its kind's own (solver/steps/); its offloaded outputs; and a
        master on disk leaves its copy (NOTE: [Masters on disk] in disk_model.py)."""
        g, M = st.g, self.st.master_bytes
        host = sig * host_bytes_streamed(g.param_bytes, g.param_numel, self.st.state_bytes, M) \
            - device * (M * g.param_numel + st.copy)
        for rule in RULES.values():
            host = host + rule.host_bytes(self, st, rule.indicator(self.v, st.s))
        return host + offloaded - mdk * (M * g.param_numel - g.param_bytes)

    def _sharded(self, s, g, mem, comm, h2d, d2h, sig, gst):
        """Stage `s` with sharded state (NOTE: [Sharded state] in runtime/sharding.py): its
        reduce-scatter in B(s-1) beside that backward, its full gradients until then, its shards
        after; resident: the step on the shard and the all-gather after it, before the next F(s);
        streamed: the all-gather at the forward prefetch, the gathered weights back to the host in F(s);
        with sharded host weights, an all-gather at the backward prefetch too, and nothing back."""
        st, L, hw, n, M = self.st, self.L, self.hw, self.n, self.st.master_bytes
        T, PRE, TAIL = 2 * len(st), 2 * len(st), 2 * len(st) + 1
        P = len(g.params)
        after = L.bw(s) + 1 if s > 0 else TAIL  # B(s-1): the window after its backward
        t_comm = comm_s(g.param_bytes, hw, n)
        comm[after] += t_comm
        ws = comm_workspace(g.param_bytes, g.param_numel, P, n)
        res = resident_sharded_bytes(g.param_bytes, g.param_numel, P, st.state_bytes, M, n)
        sg = shard_grad_bytes(g.param_bytes, g.param_numel, P, M, n)
        for t in range(T):
            mem[t] = mem[t] + res * (1 - sig[s])
        mem[L.bw(s)] = mem[L.bw(s)] + g.param_bytes * (1 - sig[s])  # full gradients, until reduced
        if after < T:
            mem[after] = mem[after] + g.param_bytes * (1 - sig[s]) + ws + sharded_step_bytes(st, s, n) * (1 - sig[s]) \
                + piece(g.param_bytes, g.param_numel, P, n) * sig[s]
            for t in range(after, T):
                mem[t] = mem[t] + sg * (1 - sig[s])
        # resident: gathered after its step, any time before the next F(s)
        windows = [L.bw(w) for w in range(s - 2, -1, -1)] + [TAIL, PRE] + [L.fw(w) for w in range(s)]
        self.spread(comm, windows, t_comm * (1 - sig[s]), f"gather{s}")
        # streamed: gathered where its forward prefetch lands; the gathered weights go back to the host
        comm[L.fw(s - 1) if s > 0 else PRE] += t_comm * sig[s]
        for t in {L.fw(max(s - 1, 0)), L.fw(s)}:
            mem[t] = mem[t] + ws * sig[s]
        if not self.zero3:
            d2h[L.fw(s)] += g.param_bytes * (sig[s] - gst[s])
        elif s < len(st) - 1:  # NOTE: [Sharded host weights] in runtime/host_weights.py: and for its backward
            comm[L.bw(s + 1)] += t_comm * sig[s]
            mem[L.bw(s + 1)] = mem[L.bw(s + 1)] + ws * sig[s]

    def _deferred_steps(self, sig):
        """`deferred_step_bytes` of the resident stages: the most of its candidates."""
        st, n = self.st, sharding(self.st)
        size = (lambda s: sharded_step_bytes(st, s, n)) if n > 1 else (lambda s: step_bytes(st, s))
        least = sharded_deferred_bytes(st, [False] * len(st), n) if n > 1 else deferred_step_bytes(st, [False] * len(st))
        tw = self.m.add_var("deferred_steps", lb=0.0)  # in units of `unit` bytes
        self.floors.append(tw)
        self.m += tw >= least / self.unit
        for s in range(len(st)):
            if size(s):
                self.m += tw >= (size(s) / self.unit) * (1 - sig[s])
        return tw * self.unit

    def spread(self, table, windows, volume, tag):
        """Split `volume` bytes over `windows` with continuous variables: transfers need not fit one window."""
        parts = [self.m.add_var(name=f"{tag}_{w}", lb=0.0) for w in windows]  # in units of `unit` bytes
        self.m += mip.xsum(parts) == volume * (1.0 / self.unit)
        for w, p in zip(windows, parts):
            table[w] = table[w] + p * self.unit



# NOTE: [Backward steps]
# A GPU-stepped streamed stage may step right after its own backward instead of at the next step's
# forward prefetch (`bstep`, with `gstep`; not the first two or the last stage): its master and states
# come in beside the backward prefetch of its weights at B(s+1), the step reads the gradient its
# backward just made, and the new weights, master and states go back during B(s-1) and B(s-2). So
# the gradient never goes to the host: no page-locked gradient buffer (its compute-dtype bytes off
# the host), and D2H carries the new weights instead of it. The `opt:S` buffer is live from B(s+1)
# to B(s-2), the weight slot and gradient to B(s-2): they are freed a window after the step and its
# write-back are issued, so compute waits for them only if they take two windows. (Freed after
# B(s-1), the 32B shape at max measured 10.19 s against 8.14 planned: the 8-bit step beside
# backward compute and the 1.95 GB write-back after it overran that window, 49 waits of about 50 ms.)
# Not the first two stages: B(s-2) is a window of backward. The step cannot know this step's global norm, so
# it needs clipping off or previous-norm (NOTE: [Gradient clipping] in runtime/stepping.py). Sharded
# state keeps its REDUCE path.
# NOTE: [Resident masters on the device]
# A resident stage's master is its home on the GPU (NOTE: [Parameter homes] in runtime/store.py):
# `bind` moves it there (`lazytrain train` loads it there: NOTE: [Masters built in place]), and the
# model's parameter points at that device tensor, so no host copy is left. The host counts only the
# streamed stages' masters. (Counted for every stage, the 32B disk plan at 104 GB spent 41.0 of its
# 94.8 GiB of host on masters the device also held.) On a CPU the device is host memory: every
# master counts. Sharded state keeps the full weights in the model's parameters (its own branch).
# NOTE: [Replicated all-reduce]
# Without sharded state (`--replicate-state`) each stage's gradients are all-reduced
# in place as its backward ends, on the compute stream (NOTE: [Data parallel] in
# runtime/data_parallel.py; the shared weights' with stage 0's): the window B(s) runs that long
# longer, in series with compute, and counts it as compute. An all-reduce is a reduce-scatter and
# an all-gather, so it takes twice `comm_s`. Left out before, the plan was 11 % optimistic on the
# 2-GPU H200 box for the 32B shape (64 all-reduces of 0.98 GB at 388 GB/s: 0.32 s of 9.73).
def byte_unit(stages: Stages) -> float:
    """Bytes per unit in the model's memory rows: about a thousandth of the model (NOTE: [MIP scaling])."""
    M = stages.master_bytes
    return max(1.0, (fixed_bytes(stages) + sum(resident_bytes(g.param_bytes, g.param_numel, stages.state_bytes, M) + g.saved_bytes
                                               for g in stages)) / 1000.0)
