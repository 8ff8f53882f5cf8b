"""Pass `solve`: choose, per stage, weight streaming, recomputation and output placement with a MIP.

Needs: `Stages` (sizes and times per stage), a `Hardware` profile and a GPU budget in bytes.
Guarantees: a `Plan` whose predicted GPU memory fits the budget in every window, minimising the
predicted step time; or `InfeasibleBudget` carrying the smallest feasible budget (found by a second
solve that minimises peak memory instead).

NOTE: [The step model]
Windows are the stages' compute phases in time order: F0..F(S-1), B(S-1)..B0, plus `pre` (before
F0) and `tail` (after B0), which hide nothing. Per stage s:
  stream[s]     weights on the host, prefetched one window ahead (F(s-1), B(s+1)); grads offloaded
                during B(s-1); AdamW runs on the CPU, spread over the windows after that
  recompute[s]  internals recomputed at B(s) (else autograd keeps them from F(s) to B(s)); costs
                `remat_s`, less than `fwd_s` where backward reads nothing of some linears (NOTE: [Skipped recompute])
  off[s]        outputs offloaded during F(s+1)..F(cmax), reloaded during B(cmax+1)
  drop[s]       outputs freed after F(s+1) and recomputed at the top of their drop segment
A chunked last stage (`chunks` > 1, pass `chunk`) runs forward and backward together, chunk by
chunk, at B(s): its compute moves there, it saves nothing from F(s) (saved_bytes 0, recompute 0)
and its working set at B(s) is one chunk's (its peak_bytes); the full-size gradient of its input is
its producers' grad_out, already counted from B(s) on.
An operator's own workspace beyond graph values (`internal_bytes`: cross-entropy's log-probabilities,
NOTE: [Operator workspace] in memory.py) is live at F(s) beside what the stage saves, and at B(s)
as their gradient; a chunked stage's one-chunk working set already holds its share.
Transfers are continuous volumes per window; a window's exposed time is the most its H2D, D2H, both
directions together, or CPU work overruns its compute (DESIGN.md). Memory per window is the sum of
the buffers `lower` keeps live there, so `verify` can check the plan event by event.
A fixed plan (the heuristic fallback) is evaluated by the same model with its binaries pinned.

NOTE: [GPU-stepped streamed stages]
gstep[s] (only with stream[s]) moves a streamed stage's AdamW step from the CPU to the GPU. Its
gradients still go to the host during B(s-1); the update itself waits for the next step's prefetch
at F(s-1): the fp32 master, the optimizer states and the gradient come in (instead of the bf16
weights), the GPU steps them and writes the new compute-dtype weights into the stage's slot, and
the master, states and new weights go back out during F(s). With ahead[s] the prefetch starts at
F(s-2) instead (the weights' and optimizer's slots are live a window longer). Gradient clipping's global norm is
known by then, and nothing waits for the host. Cost: (master + states) more bytes each way, an
`opt:S` buffer (`gpu_step_bytes`) at F(s-1) and F(s), and the GPU's step rate instead of the CPU's.

NOTE: [GPU-step lag]
A GPU-stepped stage's forward needs its step done, and the step needs its fetch landed: the two
run one after the other. With the fetch one window ahead (F(s-1)) both must fit in that window, so
the step's time is charged there after the window's transfers (`lag`). Measured on the 7B bench at
24 GiB: the forward waited about 10 ms per block for this chain when the window model alone saw
the transfers hidden. Fetched two windows ahead (`ahead`), the step runs in the next window, beside
that window's compute. The step's time still counts once in `optimizer`: the device shares its SMs
and memory bandwidth between the two streams.

NOTE: [State precision per stage]
With `--optimizer-states 8bit` a stage's states are 8-bit wherever its step runs on the GPU
(resident, or GPU-stepped streamed), and 32-bit where it runs on the CPU: bitsandbytes' 8-bit step
has no fast host path (0.09 G params/s on the H200 machine's 16 cores, against 4.5 G for torch's
fused fp32 AdamW). So choosing where a stage steps also chooses its states' precision: `stream`
without `gstep` is a 32-bit host stage, with the CPU's fp32 rate and 8 bytes of host states per
parameter (`CPU_STATE_BYTES`); everything else uses `Stages.state_bytes` and the GPU's rate for the
chosen precision. Such a host stage moves only its weights and gradient, not its states, which is
what a link-bound forward needs.
"""

from __future__ import annotations

import dataclasses
import time

import mip
from mip import cbc as _cbc

# NOTE: [CBC deadlock guard] python-mip calls CBC through cffi's ABI mode, which resolves a C
# function on first use under cffi's non-reentrant lock. `mip.Model` objects sit in reference
# cycles; if the garbage collector first frees one while that lock is held, `__del__` asks for
# `Cbc_deleteModel` and the process hangs. Resolving it once here makes `__del__` lock-free.
if getattr(_cbc, "has_cbc", False):
    _cbc.cbclib.Cbc_deleteModel  # noqa: B018

from lazytrain.errors import InfeasibleBudget, PlanError
from lazytrain.hardware import Hardware
from lazytrain.ir.plan import OutMode, Plan, SolverInfo, StageDecision
from lazytrain.passes import cuts as cuts_
from lazytrain.passes import milp
from lazytrain.passes.blocks import Stages
from lazytrain.passes.footprint import (
    CPU_STATE_BYTES,
    HOST_STEP_BYTES,
    MASTER_BYTES,
    Layout,
    backward_workspace,
    chunk_workspace,
    cpu_step_s,
    deferred_step_bytes,
    fixed_bytes,
    gpu_step_bytes,
    gpu_step_out_bytes,
    gpu_step_state_bytes,
    host_bytes_streamed,
    recompute_workspace,
    resident_bytes,
    resident_grad_bytes,
    saving_workspace,
    shared_grad_bytes,
    step_bytes,
)
from lazytrain.passes.limits import limits
from lazytrain.passes.shards import (
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
from lazytrain.units import format_size


class _Model:
    """The step model: per-window memory, compute capacity and transfer volumes as linear expressions."""

    def __init__(self, stages: Stages, hw: Hardware, vars_: dict, m: mip.Model):
        self.st, self.hw, self.m = stages, hw, m
        S = len(stages)
        self.L = L = Layout(S)
        self.v = vars_
        # NOTE: [MIP scaling] CBC misjudges optimality when the objective is ~1e-3 and byte counts
        # ~1e10 share rows with it; bytes are counted in `unit` (about a thousandth of the model)
        # and time in `unit_s` (the step's compute), so coefficients stay near 1. Variables that
        # hold bytes (R, the offload parts, twins) hold them in `unit`s too: HiGHS warns of, and
        # slows on, rows whose coefficients span more than about 1e9.
        M = stages.master_bytes
        self.unit = _byte_unit(stages)
        self.unit_s = max(1e-12, sum(g.fwd_s + g.bwd_s for g in stages))
        T = 2 * S
        sig, rec, off, drop, gst = vars_["stream"], vars_["recompute"], vars_["off"], vars_["drop"], vars_["gstep"]
        ahead = vars_["ahead"]
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
        PRE, TAIL = T, T + 1
        cap = [0.0] * (T + 2)
        self.compute = sum(s.fwd_s + s.bwd_s for s in stages)
        self.recompute = 0.0
        self.optimizer = piece(stages.shared_numel, stages.shared_numel, len(stages.shared_params), n) / hw.gpu_adamw_params_per_s
        if stages.shared_numel:  # the shared weights' reduce-scatter and all-gather after backward
            comm[TAIL] += comm_s(stages.shared_bytes, hw, n)
            self._spread(comm, [TAIL, PRE], comm_s(stages.shared_bytes, hw, n), "gather_shared")
        PK = max((s.peak_bytes for s in stages), default=0)
        for s, g in enumerate(stages):
            chunked = g.chunks > 1
            P = len(g.params)
            numel = piece(g.param_numel, g.param_numel, P, n)  # the parameters this rank steps
            cap[L.fw(s)] += 0.0 if chunked else g.fwd_s
            cap[L.bw(s)] += g.bwd_s + (g.fwd_s if chunked else g.remat_s * rec[s])
            self.recompute = self.recompute + g.remat_s * rec[s] + g.fwd_s * drop[s]  # NOTE: [Skipped recompute]
            # weights: resident (weights, grads, states) or a streamed buffer
            res = resident_bytes(g.param_bytes, g.param_numel, stages.state_bytes, M)
            rgrad = resident_grad_bytes(g.param_bytes, g.param_numel, M)
            self.optimizer = self.optimizer + (1 - sig[s]) * (numel / hw.gpu_adamw_params_per_s)
            if n > 1:
                self._sharded(s, g, mem, comm, h2d, d2h, sig, gst)
            else:
                for t in range(T):
                    mem[t] = mem[t] + res * (1 - sig[s])
                for t in range(L.bw(s), T):
                    mem[t] = mem[t] + rgrad * (1 - sig[s])
                tail = tail + (res + rgrad) * (1 - sig[s])
                # its step follows its backward in B(s), once the backward's workspace is gone
                bwd = backward_workspace(g) + (chunk_workspace(stages, s) if chunked else 0)
                mem[L.bw(s)] = mem[L.bw(s)] + max(0, step_bytes(stages, s) - bwd) * (1 - sig[s])
            for t in L.weight_windows(s):
                mem[t] = mem[t] + g.param_bytes * sig[s]
            for t in (L.bw(s), L.bw(s - 1) if s > 0 else None):
                if t is not None:
                    mem[t] = mem[t] + g.param_bytes * sig[s]
            # weight prefetch and gradient offload traffic (sharded: the forward prefetch brings this
            # rank's shard, the gradient leaves as one)
            h2d[L.fw(s - 1) if s > 0 else PRE] += piece(g.param_bytes, g.param_numel, P, n) * sig[s]
            if s < S - 1:
                h2d[L.bw(s + 1)] += g.param_bytes * sig[s]
            d2h[L.bw(s - 1) if s > 0 else TAIL] += piece(g.param_bytes, g.param_numel, P, n) * sig[s]
            self._spread(cpu, [L.bw(w) for w in range(s - 2, -1, -1)] + [TAIL],
                         (sig[s] - gst[s]) * cpu_step_s(piece(g.param_bytes, g.param_numel, P, n), numel, hw, M), f"cpu{s}")
            # GPU-stepped streamed: state in at the prefetch, out one window later
            fetch = piece(gpu_step_state_bytes(g.param_numel, stages.state_bytes, M), g.param_numel, P, n)
            h2d[L.fw(s - 1) if s > 0 else PRE] += fetch * gst[s]
            out = gpu_step_out_bytes(g.param_bytes, g.param_numel, stages.state_bytes, M)
            d2h[L.fw(s)] += (g.param_bytes + piece(out - g.param_bytes, g.param_numel, P, n) if n > 1 else out) * gst[s]
            opt_bytes = piece(gpu_step_bytes(g.param_bytes, g.param_numel, stages.state_bytes, M, g.largest_numel),
                              g.param_numel, P, n)
            for t in {L.fw(max(s - 1, 0)), L.fw(s)}:
                mem[t] = mem[t] + opt_bytes * gst[s]
            if s >= 2:  # fetched a window earlier: the whole prefetch moves, both slots live longer
                h2d[L.fw(s - 1)] -= (fetch + g.param_bytes) * ahead[s]
                h2d[L.fw(s - 2)] += (fetch + g.param_bytes) * ahead[s]
                mem[L.fw(s - 2)] = mem[L.fw(s - 2)] + (opt_bytes + g.param_bytes) * ahead[s]
            step_s = numel / hw.gpu_adamw_params_per_s
            self.optimizer = self.optimizer + gst[s] * step_s
            # the step runs once its fetch has landed, and the forward waits for it: fetched one
            # window ahead, the step trails the fetch inside that window; two ahead, a window later
            # (NOTE: [GPU-step lag])
            lag[L.fw(s - 1) if s > 0 else PRE] += (gst[s] - ahead[s]) * step_s
            # internals: saved from F(s) to B(s), or recomputed at B(s); plus backward's workspace
            for t in range(L.fw(s), L.bw(s) + 1):
                mem[t] = mem[t] + g.saved_bytes * (1 - rec[s])
            mem[L.fw(s)] = mem[L.fw(s)] + g.peak_bytes * rec[s] + saving_workspace(g) * (1 - rec[s])
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
                for t in range(L.bw(cmax), L.bw(s) + 1):
                    mem[t] = mem[t] + g.grad_out_bytes
                if cmax < S - 1:
                    self._spread(d2h, [L.fw(w) for w in range(s + 1, cmax + 1)], off[s] * g.out_bytes, f"off{s}")
                    h2d[L.bw(cmax + 1)] += g.out_bytes * off[s]
        # recomputed dropped outputs live at B(c): R[c] = drop[c-1] * (out[c-1] + R[c-1]), in `unit` bytes
        R = vars_["R"]
        for c in range(1, S):
            mem[L.bw(c)] = mem[L.bw(c)] + R[c] * self.unit + PK * drop[c - 1]
        self.mem = mem
        self.tail = tail
        if n > 1:  # the model's parameters hold the full weights in the compute dtype; the rest is shards
            self.host = sum(g.param_bytes for g in stages) + stages.shared_bytes + sum(
                sig[s] * host_shard_bytes(g.param_bytes, g.param_numel, len(g.params), stages.state_bytes, M, n)
                - gst[s] * piece(M * g.param_numel, g.param_numel, len(g.params), n) + off[s] * g.out_bytes
                + (sig[s] - gst[s]) * piece((CPU_STATE_BYTES - stages.state_bytes) * g.param_numel, g.param_numel,
                                            len(g.params), n)
                for s, g in enumerate(stages))
        else:
            self.host = sum(M * g.param_numel for g in stages) + sum(
                sig[s] * host_bytes_streamed(g.param_bytes, g.param_numel, stages.state_bytes, M)
                - gst[s] * M * g.param_numel + off[s] * g.out_bytes
                + (sig[s] - gst[s]) * (CPU_STATE_BYTES - stages.state_bytes) * g.param_numel
                for s, g in enumerate(stages))
        if M != MASTER_BYTES:  # bf16 masters: the host step's reused buffers (NOTE: [Host step buffers] in runtime/optim.py)
            buffers = m.add_var("host_step_buffers", lb=0.0)  # in units of `unit` bytes
            for s, g in enumerate(stages):
                m += buffers >= (HOST_STEP_BYTES * g.largest_numel / self.unit) * (sig[s] - gst[s])
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
        self.m += tw >= least / self.unit
        for s in range(len(st)):
            if size(s):
                self.m += tw >= (size(s) / self.unit) * (1 - sig[s])
        return tw * self.unit

    def _spread(self, table, windows, volume, tag):
        """Split `volume` over `windows` with continuous variables: transfers need not fit one window."""
        scale = self.unit if tag.startswith("off") else self.unit_s
        parts = [self.m.add_var(name=f"{tag}_{w}", lb=0.0) for w in windows]
        self.m += mip.xsum(parts) == volume * (1.0 / scale)
        for w, p in zip(windows, parts):
            table[w] = table[w] + p * scale


def _byte_unit(stages: Stages) -> float:
    """Bytes per unit in the model's memory rows: about a thousandth of the model (NOTE: [MIP scaling])."""
    M = stages.master_bytes
    return max(1.0, (fixed_bytes(stages) + sum(resident_bytes(g.param_bytes, g.param_numel, stages.state_bytes, M) + g.saved_bytes
                                               for g in stages)) / 1000.0)


def _vars(m: mip.Model, stages: Stages):
    S = len(stages)
    v = {k: [m.add_var(f"{k}{s}", var_type=mip.BINARY) for s in range(S)]
         for k in ("stream", "recompute", "off", "drop", "gstep", "ahead")}
    closed = limits(stages)  # the decisions a stage can never take (pass `limits`)
    v["R"] = [m.add_var(f"R{c}", lb=0.0) for c in range(S)]  # in `_byte_unit` bytes (NOTE: [MIP scaling])
    unit = _byte_unit(stages)
    for s, g in enumerate(stages):
        sig, rec, off, drop = v["stream"][s], v["recompute"][s], v["off"][s], v["drop"][s]
        m += off + drop <= 1
        m += v["gstep"][s] <= sig
        m += v["ahead"][s] <= v["gstep"][s]
        if s < 2:
            m += v["ahead"][s] == 0
        if closed[s].stream:
            m += sig == 0
        elif s < S - 1:
            # A streamed stage's weights leave between its forward and backward, but internals that
            # autograd saved are views of them: such a stage must recompute (the last stage's
            # weights stay from F to B, so it may save).
            m += sig <= rec
        if closed[s].recompute:
            m += rec == 0
        if closed[s].offload:
            m += off == 0
        # a saving stage's autograd graph holds its outputs on the GPU until its backward: moving
        # or dropping them would free nothing
        if g.chunks == 1 and g.consumers:
            m += off <= rec
            m += drop <= rec
        for c in g.consumers:
            m += off <= v["recompute"][c]
        if closed[s].drop:
            m += drop == 0
        else:
            m += drop <= v["recompute"][s + 1]
            m += drop <= 1 - sig
            for p in g.producers:
                m += drop <= 1 - v["off"][p]
    m += v["R"][0] == 0
    # Without drop[c-1] the row must leave R[c] free: the least R[c-1] is at most the outputs of the
    # stages before c-1, so those and out[c-1] are a big enough M (a tighter one, a tighter relaxation).
    below = 0
    for c in range(1, S):
        below += stages[c - 1].out_bytes
        m += v["R"][c] >= v["R"][c - 1] + (stages[c - 1].out_bytes - below * (1 - v["drop"][c - 1])) / unit
    return v


def _exposure(m: mip.Model, model: _Model, hw: Hardware, v, cuts: bool):
    modes = cuts_.modes(v)
    exposed = []  # seconds; the variables hold them in units of `unit_s`
    k = 1.0 / model.unit_s
    for t in range(len(model.cap)):
        e = m.add_var(f"exposed{t}", lb=0.0)
        h, d, c, cap, lag = model.h2d[t], model.d2h[t], model.cpu[t], model.cap[t], model.lag[t]
        m += e >= model.comm[t] * k - cap * k  # the ranks' collectives (NOTE: [Link bandwidth])
        m += e >= h * (k / hw.h2d_bandwidth) + lag * k - cap * k
        m += e >= d * (k / hw.d2h_bandwidth) - cap * k
        m += e >= (h + d) * (0.5 * k / hw.duplex_bandwidth) + lag * k - cap * k
        m += e >= c * k - cap * k
        if cuts:  # NOTE: [Exposure cuts] in cuts.py
            for load in (h * (k / hw.h2d_bandwidth) + lag * k, d * (k / hw.d2h_bandwidth),
                         (h + d) * (0.5 * k / hw.duplex_bandwidth) + lag * k):
                cuts_.exposure_cut(m, v, e, load, cap * k, modes)
        exposed.append(e * model.unit_s)
    return exposed


def _build(stages, hw, budget, minimise_memory: bool, fixed: list[StageDecision] | None = None, cuts: bool = True):
    """The MIP; `cuts`: with the valid rows of passes/cuts.py, which change no plan's value."""
    m = mip.Model(sense=mip.MINIMIZE, solver_name=mip.CBC)
    m.verbose = 0
    m.threads = 1
    v = _vars(m, stages)
    if fixed is not None:
        for s, d in enumerate(fixed):
            m += v["stream"][s] == int(d.stream)
            m += v["recompute"][s] == int(d.recompute)
            m += v["off"][s] == int(d.outputs is OutMode.OFFLOAD)
            m += v["drop"][s] == int(d.outputs is OutMode.DROP)
            m += v["gstep"][s] == int(d.gpu_step)
            m += v["ahead"][s] == int(d.lookahead == 2)
    model = _Model(stages, hw, v, m)
    exposed = _exposure(m, model, hw, v, cuts)
    u = 1.0 / model.unit
    m += model.host * u <= hw.host_capacity * u
    step = (model.compute + model.recompute + model.optimizer + mip.xsum(exposed)) * (1.0 / model.unit_s)
    if minimise_memory:
        peak = m.add_var("peak", lb=0.0)
        for t in model.mem + [model.tail]:
            m += t * u <= peak
        # Among the smallest plans, prefer the fastest.
        m.objective = mip.minimize(peak + 1e-6 * step)
    else:
        for t in model.mem + [model.tail]:  # NOTE: [Allocator reserve] in hardware/__init__.py
            m += t * u <= (budget - hw.allocator_reserve_bytes) * u
            if cuts:  # NOTE: [Memory cliques] in cuts.py
                cuts_.memory_clique(m, t * u, (budget - hw.allocator_reserve_bytes) * u)
        m.objective = mip.minimize(step)
    return m, v, model, exposed


def _decisions(v, S, val) -> list[StageDecision]:
    out = []
    for s in range(S):
        on = {k: val(v[k][s]) > 0.5 for k in ("stream", "recompute", "off", "drop", "gstep", "ahead")}
        mode = OutMode.OFFLOAD if on["off"] else OutMode.DROP if on["drop"] else OutMode.KEEP
        out.append(StageDecision(on["stream"], on["recompute"], mode, on["gstep"], 2 if on["ahead"] else 1))
    return out


def heuristics(stages: Stages) -> dict[str, list[StageDecision]]:
    """Fixed policies, as layer-streaming trainers use: warm starts for CBC and the fallback when
    the solver finds nothing in time."""
    closed = limits(stages)

    def policy(stream: bool, recompute: bool, gpu_step: bool = False) -> list[StageDecision]:
        return [StageDecision(stream and not lim.stream, recompute and not lim.recompute, OutMode.KEEP,
                              gpu_step and stream and not lim.stream) for lim in closed]
    return {
        "stream every block, checkpoint every block": policy(True, True),
        "stream every block, optimizer on the GPU, checkpoint every block": policy(True, True, gpu_step=True),
        "everything resident, checkpoint every block": policy(False, True),
        "everything resident and saved": policy(False, False),
    }


def _warm_start(stages: Stages, hw: Hardware, budget: int) -> tuple[str, Plan] | None:
    """The fastest heuristic plan that fits, or None. (CBC mishandles an infeasible start, so only
    a plan checked to fit is offered.)"""
    fits = []
    for name, decisions in heuristics(stages).items():
        try:
            fits.append((name, evaluate(stages, hw, budget, decisions, status="fallback")))
        except PlanError:
            continue
    return min(fits, key=lambda f: f[1].step_s) if fits else None


def _start(v, decisions: list[StageDecision]) -> dict:
    return {v[key][s]: float(value) for s, d in enumerate(decisions) for key, value in (
        ("stream", d.stream), ("recompute", d.recompute), ("off", d.outputs is OutMode.OFFLOAD),
        ("drop", d.outputs is OutMode.DROP), ("gstep", d.gpu_step), ("ahead", d.lookahead == 2))}


def _plan(stages, hw, budget, v, model, exposed, r: milp.Result, info: SolverInfo) -> Plan:
    def val(e) -> float:  # solver values carry tolerance noise: no negative seconds or bytes
        return max(0.0, milp.value(e, r))
    dec = _decisions(v, len(stages), val)
    mem = [int(round(val(t))) for t in model.mem]
    secs = [val(model.cap[t]) + val(exposed[t]) for t in range(len(mem))]
    tail = tail_bytes(stages, dec, hw)  # exact: the solver may leave its `deferred_steps` above their least
    edges = [("pre", 0, val(exposed[-2]))] + list(zip(model.L.labels(), mem, secs)) + [("tail", tail, val(exposed[-1]))]
    return Plan(
        decisions=tuple(dec), budget=budget, peak_bytes=max(mem + [tail]), host_bytes=int(round(val(model.host))),
        step_s=val(model.compute + model.recompute + model.optimizer + mip.xsum(exposed)),
        compute_s=model.compute, recompute_s=val(model.recompute), exposed_s=sum(val(e) for e in exposed),
        optimizer_s=val(model.optimizer), windows=tuple(edges), solver=info,
    )


def tail_bytes(stages: Stages, decisions, hw: Hardware) -> int:
    """GPU bytes after backward: resident weights, their gradients, and the steps gradient clipping
    defers until then (NOTE: [Resident steps])."""
    M = stages.master_bytes
    resident = [not d.stream for d in decisions]
    n = sharding(stages)
    if n > 1:
        return sharded_tail(stages, hw, [int(r) for r in resident], sharded_deferred_bytes(stages, resident, n), n)
    return fixed_bytes(stages) + hw.runtime_bytes + shared_grad_bytes(stages) + deferred_step_bytes(stages, resident) + sum(
        resident_bytes(g.param_bytes, g.param_numel, stages.state_bytes, M) + resident_grad_bytes(g.param_bytes, g.param_numel, M)
        for g, r in zip(stages, resident) if r)


def smallest_budget(stages: Stages, hw: Hardware, time_limit: float = 30.0) -> int:
    """The least GPU memory any plan needs (a solve that minimises peak memory)."""
    m, v, model, exposed = _build(stages, hw, None, minimise_memory=True)
    # Min-max objectives have many near-ties; proving the last 1% can take CBC minutes. The plan
    # found is feasible either way, so the budget it names always works.
    r = milp.optimize(m, time_limit, 1e-2)
    if not r.found:
        weights = stages.master_bytes * (sum(g.param_numel for g in stages) + stages.shared_numel)
        if weights > hw.host_capacity:
            raise PlanError(
                f"the model's master weights alone ({format_size(weights)}) exceed the host memory plans may use on hardware "
                f"profile '{hw.name}' ({format_size(hw.host_capacity)}); use a profile of a machine with more host memory")
        raise PlanError(f"no plan fits even with unlimited GPU memory (solver: {r.status}); the host memory plans "
                        f"may use on '{hw.name}' ({format_size(hw.host_capacity)}) is too small for the optimizer "
                        "states and offloaded tensors this model needs")
    return max(int(round(milp.value(t, r))) for t in model.mem + [model.tail]) + hw.allocator_reserve_bytes


GAP = 1e-2  # the relative gap a solve stops at; reported in the plan (NOTE: [HiGHS beside CBC] in milp.py)


def solve(stages: Stages, hw: Hardware, budget: int, time_limit: float = 60.0, gap: float = GAP) -> Plan:
    start = time.perf_counter()
    # CBC searches better from a start; HiGHS finds one as fast as the heuristics are evaluated,
    # so they are evaluated only if it finds none (the fallback below).
    warm = _warm_start(stages, hw, budget) if milp.solver_name() == "cbc" else None
    t_warm = time.perf_counter()
    m, v, model, exposed = _build(stages, hw, budget, minimise_memory=False)
    t_build = time.perf_counter()
    r = milp.optimize(m, max(1.0, time_limit - (t_build - start)), gap,
                      _start(v, warm[1].decisions) if warm is not None else None)
    took = time.perf_counter() - start
    times = ((("heuristics", t_warm - start),) if warm else ()) + (
        ("model", t_build - t_warm), ("handover", r.setup_s), ("search", r.search_s))
    if r.found:
        info = SolverInfo(r.status, r.gap, r.objective * model.unit_s, r.bound * model.unit_s, took,
                          solver=r.solver, times=times)
        plan = _plan(stages, hw, budget, v, model, exposed, r, info)
        extract = time.perf_counter() - start - took
        return dataclasses.replace(plan, solver=dataclasses.replace(
            info, seconds=took + extract, times=times + (("plan", extract),)))
    if r.status == milp.INFEASIBLE:
        need = smallest_budget(stages, hw)
        have, want = format_size(budget), format_size(need, round_up=True)
        if have == want:  # one decimal cannot tell them apart: give bytes too
            have, want = f"{have} ({budget} bytes)", f"{want} ({need} bytes)"
        raise InfeasibleBudget(
            f"no plan fits a GPU budget of {have}; smallest feasible budget: {want}. "
            "Raise --budget, or shrink the batch",
            need,
        )
    # Time-out without a solution: use the best heuristic policy that fits.
    warm = warm or _warm_start(stages, hw, budget)
    if warm is None:
        raise PlanError(f"the solver found no plan in {time_limit:.0f}s and no heuristic policy fits "
                        f"{format_size(budget)}; raise --time-limit or --budget")
    name, plan = warm
    msg = f"the solver found no plan in {time_limit:.0f}s; fell back to the heuristic '{name}'"
    return dataclasses.replace(plan, solver=dataclasses.replace(plan.solver, message=msg, seconds=took))


def evaluate(stages: Stages, hw: Hardware, budget: int, decisions: list[StageDecision], *,
             status: str = "fixed", message: str = "") -> Plan:
    """The plan for given decisions: transfer placement solved, memory and time predicted. Raises
    `PlanError` if the decisions break a rule (e.g. dropping outputs a saved stage needs) or the budget."""
    start = time.perf_counter()
    m, v, model, exposed = _build(stages, hw, budget, minimise_memory=False, fixed=decisions)
    r = milp.optimize(m, 60.0, 1e-4)
    if not r.found:
        raise PlanError(f"the given decisions are not a valid plan within {format_size(budget)} (solver: {r.status})")
    objective = r.objective * model.unit_s
    info = SolverInfo(status, 0.0, objective, objective, time.perf_counter() - start, message, solver=r.solver)
    return _plan(stages, hw, budget, v, model, exposed, r, info)
