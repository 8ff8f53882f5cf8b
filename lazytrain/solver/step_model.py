"""The step model of pass `solve` (NOTE: [The step model] in solve.py): per-window memory, compute
capacity, transfer volumes, host work and collectives of one training step, as linear expressions
over the MIP's decision variables (`solve._vars`), which `solve._build` prices and bounds.
"""

from __future__ import annotations

import mip

from lazytrain.hardware import Hardware
from lazytrain.ir.stages import Stages
from lazytrain.solver.backlog import backlog
from lazytrain.solver.disk_model import disk_tier
from lazytrain.solver.footprint import (
    CPU_STATE_BYTES,
    HOST_STEP_BYTES,
    MASTER_BYTES,
    Layout,
    backward_step_bytes,
    backward_workspace,
    cast_s,
    chunk_workspace,
    cpu_step_s,
    deferred_step_bytes,
    disk_available,
    disk_gpu_job_s,
    disk_gpu_state_bytes,
    disk_io_s,
    disk_step_s,
    fixed_bytes,
    flush_bytes,
    forward_workspace,
    gpu_step_bytes,
    gpu_step_s,
    gpu_step_out_bytes,
    gpu_step_state_bytes,
    host_bytes_streamed,
    master_staging_bytes,
    recompute_workspace,
    resident_bytes,
    resident_grad_bytes,
    saving_workspace,
    shared_grad_bytes,
    step_bytes,
    weights_from_master,
)
from lazytrain.solver.shards import (
    allreduce_s,
    comm_s,
    comm_workspace,
    host_shard_bytes,
    piece,
    resident_sharded_bytes,
    shard_grad_bytes,
    sharded_deferred_bytes,
    sharded_step_bytes,
    sharded_tail,
    sharding,
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
        sig, rec, off, drop, gst = vars_["stream"], vars_["recompute"], vars_["off"], vars_["drop"], vars_["gstep"]
        ahead, dst, bst, mdk = vars_["ahead"], vars_["dstep"], vars_["bstep"], vars_["mdisk"]
        n = self.n = sharding(stages)  # NOTE: [Sharded state] in runtime/sharding.py
        steps = self._deferred_steps(sig)
        fixed = fixed_bytes(stages) + hw.runtime_bytes
        if n > 1:  # the shared weights' states and master are sharded too
            fixed += resident_sharded_bytes(stages.shared_bytes, stages.shared_numel, len(stages.shared_params),
                                            stages.state_bytes, M, n) - resident_bytes(
                stages.shared_bytes, stages.shared_numel, stages.state_bytes, M)
        mem = [fixed for _ in range(T)]
        for t in range(S, T):  # shared (tied) weights' gradients, from the first backward on
            mem[t] = mem[t] + (stages.shared_bytes if n > 1 else shared_grad_bytes(stages))
        # after backward: resident weights and their gradients, and the steps clipping defers (NOTE: [Resident steps])
        tail = sharded_tail(stages, hw, [1 - x for x in sig], steps, n) if n > 1 else \
            fixed_bytes(stages) + hw.runtime_bytes + shared_grad_bytes(stages) + steps
        h2d = [0.0] * (T + 2)  # index T is `pre`, T+1 is `tail`
        comm = [0.0] * (T + 2)  # seconds of collectives on the ranks' link (NOTE: [Link bandwidth])
        lag = [0.0] * (T + 2)  # seconds of device work that must follow a window's H2D before its end
        d2h = [0.0] * (T + 2)
        cpu = [0.0] * (T + 2)
        released = [0.0] * (T + 2)  # host step seconds that may start in a window (NOTE: [Host step backlog] in backlog.py)
        due = [0.0] * (T + 2)  # host step seconds that must be done by a window's end (exact clipping)
        exact = stages.clipping == "exact"
        PRE, TAIL = T, T + 1
        cap = [0.0] * (T + 2)
        self.compute = sum(s.fwd_s + s.bwd_s for s in stages)
        self.recompute = 0.0
        # device steps: `optimizer` all of them; `serial` those in series with compute; the rest run
        # on the optimizer stream beside backward (NOTE: [Device steps beside compute])
        on_stream = n == 1 and not exact and hw.gpu_step_pace > 0
        stepped = [0.0] * (T + 2)  # device step seconds released to the optimizer stream in a window
        step_due = [0.0] * (T + 2)  # of them, what must be done by a window's end (resident gradients freed)
        self.optimizer = gpu_step_s(piece(stages.shared_numel, stages.shared_numel, len(stages.shared_params), n),
                                    len(stages.shared_params), hw, M)
        if on_stream:
            stepped[TAIL] += self.optimizer
        self.serial = 0.0 if on_stream else self.optimizer
        if stages.shared_numel:  # the shared weights' reduce-scatter and all-gather after backward
            comm[TAIL] += comm_s(stages.shared_bytes, hw, n)
            self._spread(comm, [TAIL, PRE], comm_s(stages.shared_bytes, hw, n), "gather_shared")
        PK = max((s.peak_bytes for s in stages), default=0)
        disk_ok = stages.disk and n == 1 and disk_available(hw)
        # per stage, with the disk tier: (window released, window due by, host worker seconds, of
        # them a disk-stepped job's)
        self.host_jobs: list[tuple[int, int, object, object]] = []
        # of the host worker's jobs, the disk's seconds: released and due with their jobs (NOTE: [One disk] in disk_model.py)
        self.job_disk_released, self.job_disk_due = [0.0] * (T + 2), [0.0] * (T + 2)
        from_master = [weights_from_master(stages, s) for s in range(S)]  # if GPU-stepped (gst, dst)
        for s, g in enumerate(stages):
            chunked = g.chunks > 1
            P = len(g.params)
            numel = piece(g.param_numel, g.param_numel, P, n)  # the parameters this rank steps
            cap[L.fw(s)] += 0.0 if chunked else g.fwd_s
            cap[L.bw(s)] += g.bwd_s + (g.fwd_s if chunked else g.remat_s * rec[s])
            self.recompute = self.recompute + g.remat_s * rec[s] + g.fwd_s * drop[s]  # NOTE: [Skipped recompute]
            if stages.world_size > 1 and n == 1:  # NOTE: [Replicated all-reduce]
                reduce_s = allreduce_s(g.param_bytes + (stages.shared_bytes if s == 0 else 0), hw, stages.world_size)
                cap[L.bw(s)] += reduce_s
                self.compute += reduce_s
            # weights: resident (weights, grads, states) or a streamed buffer
            res = resident_bytes(g.param_bytes, g.param_numel, stages.state_bytes, M)
            rgrad = resident_grad_bytes(g.param_bytes, g.param_numel, M)
            step_s = gpu_step_s(numel, P, hw, M)
            self.optimizer = self.optimizer + (1 - sig[s]) * step_s
            if on_stream:  # released as its backward ends
                stepped[L.bw(s - 1) if s > 0 else TAIL] += (1 - sig[s]) * step_s
            else:
                self.serial = self.serial + (1 - sig[s]) * step_s
            if n > 1:
                self._sharded(s, g, mem, comm, h2d, d2h, sig, gst)
            else:
                # NOTE: [Resident weights cast on use] in footprint.py: no compute copy between uses
                cast = vars_["cast"][s]
                res = res * (1 - sig[s]) - g.param_bytes * cast
                for t in (L.fw(s), L.bw(s)):
                    mem[t] = mem[t] + g.param_bytes * cast
                self.recompute = self.recompute + cast_s(g, hw, M) * cast * 2
                cap[L.fw(s)] += cast_s(g, hw, M) * cast
                cap[L.bw(s)] += cast_s(g, hw, M) * cast
                for t in range(T):
                    mem[t] = mem[t] + res
                # NOTE: [Resident gradients freed at their step] in footprint.py: until B(s-2), or the tail
                freed = vars_["free"][s]
                for t in range(L.bw(s), T):
                    mem[t] = mem[t] + rgrad * (1 - sig[s] - (freed if t > L.bw(s - 2) else 0))
                if s >= 2:
                    step_due[L.bw(s - 2)] += freed * step_s
                tail = tail + res + rgrad * (1 - sig[s] - freed)
                # its step follows its backward in B(s), once the backward's workspace is gone
                bwd = backward_workspace(g) + (chunk_workspace(stages, s) if chunked else 0)
                mem[L.bw(s)] = mem[L.bw(s)] + max(0, step_bytes(stages, s) - bwd) * (1 - sig[s])
            # NOTE: [Weights from the master] in footprint.py: a GPU-stepped stage's slot stages its
            # master, plain prefetches bring the master, and the host keeps no compute-dtype copy
            # (NOTE: [Masters on disk] in disk_model.py: not where the master is on disk, `mdk`)
            copy, staging = (g.param_bytes, master_staging_bytes(g)) if from_master[s] else (0, 0)
            extra = M * g.param_numel - g.param_bytes if from_master[s] else 0
            for t in L.weight_windows(s):
                mem[t] = mem[t] + g.param_bytes * sig[s] + staging * (gst[s] + dst[s] - mdk[s])
            for t in (L.bw(s), L.bw(s - 1) if s > 0 else None):
                if t is not None:
                    mem[t] = mem[t] + g.param_bytes * sig[s] + staging * (gst[s] + dst[s] - mdk[s])
            # weight prefetch and gradient offload traffic (sharded: the forward prefetch brings this
            # rank's shard, the gradient leaves as one); a forward prefetch after a step brings none
            h2d[L.fw(s - 1) if s > 0 else PRE] += (piece(g.param_bytes, g.param_numel, P, n) * sig[s]
                                                   + extra * (bst[s] + dst[s] - mdk[s]))
            if s < S - 1:
                h2d[L.bw(s + 1)] += g.param_bytes * sig[s] + extra * (gst[s] + dst[s] - mdk[s])
            d2h[L.bw(s - 1) if s > 0 else TAIL] += piece(g.param_bytes, g.param_numel, P, n) * sig[s]
            # a host step can start once its gradient has landed (B(s-2)), or with exact clipping once
            # backward has ended; it must end before its next prefetch (NOTE: [Host step deadlines])
            host_s = (sig[s] - gst[s] - dst[s]) * cpu_step_s(piece(g.param_bytes, g.param_numel, P, n), numel, hw, M)
            release = L.bw(s - 2) if s >= 2 and not exact else TAIL
            prefetched = (TAIL, PRE)[s] if s < 2 else L.fw(s - 2)  # the end of the window before its prefetch
            job_s = 0.0  # a disk-stepped stage's job: due only before its next prefetch (NOTE: [Disk-stepped stages] in disk_model.py)
            if disk_ok:  # NOTE: [Disk-resident states] in disk_model.py
                host_disk = vars_["disk"][s] * disk_step_s(g.param_numel, hw)
                host_s = host_s + host_disk
                job_s = dst[s] * disk_gpu_job_s(g.param_bytes, g.param_numel, P, hw, stages.state_bytes, M)
                job_disk = dst[s] * disk_io_s(disk_gpu_state_bytes(g.param_numel, stages.state_bytes), hw)
                self.job_disk_released[release] += host_disk + job_disk
                self.job_disk_due[prefetched] += job_disk
                self.job_disk_due[prefetched if exact else TAIL] += host_disk
                self.optimizer = self.optimizer + dst[s] * step_s
                self.serial = self.serial + dst[s] * (step_s * hw.gpu_step_lost)  # beside compute
                self.host_jobs.append((release, prefetched, host_s + job_s, job_s))  # NOTE: [Jobs due in release order's reverse] in backlog.py
            else:
                m += vars_["disk"][s] == 0
                m += dst[s] == 0
            released[release] += host_s + job_s
            due[prefetched if exact else TAIL] += host_s
            due[prefetched] += job_s
            # GPU-stepped streamed at the next forward: state in at the prefetch, out one window later
            fwd = gst[s] - bst[s]
            fetch = piece(gpu_step_state_bytes(g.param_numel, stages.state_bytes, M), g.param_numel, P, n)
            h2d[L.fw(s - 1) if s > 0 else PRE] += fetch * fwd
            out = gpu_step_out_bytes(g.param_bytes, g.param_numel, stages.state_bytes, M)
            d2h[L.fw(s)] += (g.param_bytes + piece(out - g.param_bytes, g.param_numel, P, n) if n > 1 else out - copy) * fwd
            opt_bytes = piece(gpu_step_bytes(g.param_bytes, g.param_numel, stages.state_bytes, M, g.largest_numel),
                              g.param_numel, P, n)
            # in backward: NOTE: [Backward step twins] in footprint.py
            back_bytes = backward_step_bytes(g.param_bytes, g.param_numel, stages.state_bytes, M, g.largest_numel)
            for t in {L.fw(max(s - 1, 0)), L.fw(s)}:
                mem[t] = mem[t] + opt_bytes * fwd
            if 2 <= s < S - 1:  # NOTE: [Backward steps]
                h2d[L.bw(s + 1)] += (out - g.param_bytes) * bst[s]  # master and states, beside the weights
                # new weights (not the gradient), master and states, after the step: in B(s-1) or B(s-2)
                d2h[L.bw(s - 1)] -= g.param_bytes * bst[s]
                self._spread(d2h, [L.bw(s - 1), L.bw(s - 2)], (out - copy) * bst[s] + copy * mdk[s], f"back{s}")
                for t in (L.bw(s + 1), L.bw(s), L.bw(s - 1), L.bw(s - 2)):
                    mem[t] = mem[t] + back_bytes * bst[s]
                for t in (L.bw(s - 1), L.bw(s - 2)):  # the weights until written back, the gradient until stepped
                    mem[t] = mem[t] + (g.param_bytes + staging) * bst[s] - staging * mdk[s]
                mem[L.bw(s - 2)] = mem[L.bw(s - 2)] + g.param_bytes * bst[s]
            if s >= 2:  # fetched a window earlier: the whole prefetch moves, both slots live longer
                h2d[L.fw(s - 1)] -= (fetch + g.param_bytes) * ahead[s]
                h2d[L.fw(s - 2)] += (fetch + g.param_bytes) * ahead[s]
                mem[L.fw(s - 2)] = mem[L.fw(s - 2)] + (opt_bytes + g.param_bytes + staging) * ahead[s]
            self.optimizer = self.optimizer + gst[s] * step_s
            self.serial = self.serial + fwd * step_s
            # NOTE: [Backward steps]: on the optimizer stream beside backward's compute
            self.serial = self.serial + bst[s] * (step_s * hw.gpu_step_lost)
            # the step runs on the compute stream before its forward, once its fetch has landed:
            # fetched one window ahead, it trails the fetch inside that window; two ahead, the
            # fetch is in by then. Transfers run beside it as beside compute (NOTE: [GPU-step lag])
            lag[L.fw(s - 1) if s > 0 else PRE] += (fwd - ahead[s]) * step_s
            cap[L.fw(s - 1) if s > 0 else PRE] += fwd * step_s
            # internals: saved from F(s) to B(s), or recomputed at B(s); plus backward's workspace
            for t in range(L.fw(s), L.bw(s) + 1):
                mem[t] = mem[t] + g.saved_bytes * (1 - rec[s])
            mem[L.fw(s)] = mem[L.fw(s)] + forward_workspace(g) * rec[s] + saving_workspace(g) * (1 - rec[s])
            mem[L.bw(s)] = mem[L.bw(s)] + backward_workspace(g) + recompute_workspace(g) * rec[s]
            if chunked:  # one chunk's forward and backward
                mem[L.bw(s)] = mem[L.bw(s)] + chunk_workspace(stages, s)
            # output activations
            if g.consumers:
                cmin, cmax = g.consumers[0], g.consumers[-1]
                keep = 1 - off[s] - drop[s]
                for t in range(L.fw(s), L.bw(cmin) + 1):
                    mem[t] = mem[t] + g.out_bytes * keep
                # a saving stage's autograd graph holds its outputs until its own backward
                # (it then keeps them: `_vars`), when its last reader came before
                for t in range(L.bw(cmin) + 1, L.bw(s) + 1):
                    mem[t] = mem[t] + g.out_bytes * (1 - rec[s])
                for t in list(range(L.fw(s), L.fw(cmax) + 1)) + list(range(L.bw(cmax + 1), L.bw(cmin) + 1)) if cmax < S - 1 else []:
                    mem[t] = mem[t] + g.out_bytes * off[s]
                for t in (L.fw(s), L.fw(s + 1)):
                    mem[t] = mem[t] + g.out_bytes * drop[s]
                for t in range(L.bw(stages.grad_maker(s)), L.bw(s) + 1):
                    mem[t] = mem[t] + g.grad_out_bytes
                if cmax < S - 1:
                    self._spread(d2h, [L.fw(w) for w in range(s + 1, cmax + 1)], off[s] * g.out_bytes, f"off{s}")
                    h2d[L.bw(cmax + 1)] += g.out_bytes * off[s]
        # NOTE: [Host step deadlines] in runtime/stepping.py's [Gradient clipping]: unclipped, host
        # steps end by the step's end (the runtime waits for them there); with exact clipping they
        # start after backward and run on into the next step's forward, each done before its prefetch;
        # disk-stepped stages' jobs may always do so (NOTE: [Disk-stepped stages] in disk_model.py)
        into_forward = [PRE] + [L.fw(j) for j in range(S - 2)]
        hosted = self.hosted = [TAIL] + into_forward if exact else list(range(S, T)) + [TAIL] + (into_forward if disk_ok else [])
        for w, done in backlog(m, released, hosted, self.unit_s, due if exact or disk_ok else None).items():
            cpu[w] = cpu[w] + done
        # NOTE: [Device steps beside compute] in hardware/__init__.py: the optimizer stream runs its
        # steps in the order released, at `gpu_step_pace` beside compute, and finishes after backward
        # (the next forward's first stage waits for the last step); compute loses `gpu_step_lost` of
        # what runs beside it, and what is left after backward runs alone
        self.beside = [0.0] * (T + 2)  # seconds a window runs longer for the steps beside or after it
        if on_stream:
            windows = [L.bw(w) for w in range(S - 2, -1, -1)] + [TAIL]
            for w, done in backlog(m, stepped, windows, self.unit_s, step_due).items():
                if w == TAIL:
                    self.beside[w] = done
                else:
                    m += done * (1.0 / self.unit_s) <= cap[w] * (hw.gpu_step_pace / self.unit_s)
                    self.beside[w] = done * hw.gpu_step_lost
        # recomputed dropped outputs live at B(c): R[c] = drop[c-1] * (out[c-1] + R[c-1]), in `unit` bytes
        R = vars_["R"]
        self.floors.extend(R)
        for c in range(1, S):
            mem[L.bw(c)] = mem[L.bw(c)] + R[c] * self.unit + PK * drop[c - 1]
        self.mem = mem
        # NOTE: [Flushed updates] in footprint.py: one GPU-stepped stage's update applied between steps
        if n == 1:
            flush = m.add_var("flush", lb=0.0)  # in units of `unit` bytes
            self.floors.append(flush)
            for s in range(S):
                m += flush >= (flush_bytes(stages, s) / self.unit) * (gst[s] - vars_["bstep"][s])
            tail = tail + flush * self.unit
        self.tail = tail
        if n > 1:  # the model's parameters hold the full weights in the compute dtype; the rest is shards
            self.host = sum(g.param_bytes for g in stages) + stages.shared_bytes + sum(
                sig[s] * host_shard_bytes(g.param_bytes, g.param_numel, len(g.params), stages.state_bytes, M, n)
                - gst[s] * piece(M * g.param_numel, g.param_numel, len(g.params), n) + off[s] * g.out_bytes
                + (sig[s] - gst[s]) * piece((CPU_STATE_BYTES - stages.state_bytes) * g.param_numel, g.param_numel,
                                            len(g.params), n)
                for s, g in enumerate(stages))
        else:  # NOTE: [Resident masters on the device]
            placed = hw.device == "cuda"
            self.host = sum(M * g.param_numel * (sig[s] if placed else 1) for s, g in enumerate(stages)) + sum(
                sig[s] * host_bytes_streamed(g.param_bytes, g.param_numel, stages.state_bytes, M)
                - (gst[s] + dst[s]) * (M * g.param_numel + (g.param_bytes if from_master[s] else 0))
                - bst[s] * g.param_bytes + off[s] * g.out_bytes
                - mdk[s] * (M * g.param_numel - g.param_bytes)  # NOTE: [Masters on disk]: the copy stays, the master goes
                + (sig[s] - gst[s] - dst[s]) * (CPU_STATE_BYTES - stages.state_bytes) * g.param_numel
                for s, g in enumerate(stages))
        disk_tier(self, disk_ok, TAIL)  # the offload file: its bytes, the host they free, the disk's seconds
        if M != MASTER_BYTES:  # bf16 masters: the host step's reused buffers (NOTE: [Host step buffers] in runtime/optim.py)
            buffers = m.add_var("host_step_buffers", lb=0.0)  # in units of `unit` bytes
            self.floors.append(buffers)
            for s, g in enumerate(stages):
                m += buffers >= (HOST_STEP_BYTES * g.largest_numel / self.unit) * (sig[s] - gst[s] - dst[s])
            self.host = self.host + buffers * self.unit
        self.h2d, self.d2h, self.cpu, self.cap, self.lag, self.comm = h2d, d2h, cpu, cap, lag, comm

    def _sharded(self, s, g, mem, comm, h2d, d2h, sig, gst):
        """Stage `s` with sharded state (NOTE: [Sharded state] in runtime/sharding.py): its
        reduce-scatter in B(s-1) beside that backward, its full gradients until then, its shards
        after; resident: the step on the shard and the all-gather after it, before the next F(s);
        streamed: the all-gather at the forward prefetch, the gathered weights back to the host in F(s)."""
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
        self._spread(comm, windows, t_comm * (1 - sig[s]), f"gather{s}")
        # streamed: gathered where its forward prefetch lands; the gathered weights go back to the host
        comm[L.fw(s - 1) if s > 0 else PRE] += t_comm * sig[s]
        for t in {L.fw(max(s - 1, 0)), L.fw(s)}:
            mem[t] = mem[t] + ws * sig[s]
        d2h[L.fw(s)] += g.param_bytes * (sig[s] - gst[s])

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

    def _spread(self, table, windows, volume, tag):
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
# Without sharded state (8-bit states, `--replicate-state`) each stage's gradients are all-reduced
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
