"""Kind "prefetch": a streamed stage stepped on the device at the next step's forward prefetch of its
weights (NOTE: [GPU-stepped streamed stages] in solver/formulation.py): its gradient waits in host memory,
the prefetch brings master, states and gradient with the weights, the step runs on the compute
stream before its forward (NOTE: [GPU-step lag] in solver/formulation.py), and the new weights, master and
states go back during its forward. Fetched one window ahead, or two (`ahead`, `Weights.lookahead`)."""

from __future__ import annotations

from lazytrain.ir.events import Kind, Stream
from lazytrain.solver.footprint import flush_bytes, gpu_step_bytes, gpu_step_out_bytes, gpu_step_state_bytes
from lazytrain.solver.shards import piece
from lazytrain.solver.steps.base import StreamedRule, rule


@rule
class AtPrefetch(StreamedRule):
    kind = "prefetch"
    host_grad_persistent = True  # last step's gradient, read at this step's prefetch: it outlives the step

    @staticmethod
    def indicator(v, s):
        return v["gstep"][s] - v["bstep"][s]

    def transfers(self, model, st, x):
        s, g, L, n, stages = st.s, st.g, model.L, model.n, model.st
        P, M, ahead = len(g.params), stages.master_bytes, model.v["ahead"][s]
        fetched = L.fw(s - 1) if s > 0 else model.PRE
        # state in at the prefetch, out one window later
        fetch = piece(gpu_step_state_bytes(g.param_numel, stages.state_bytes, M), g.param_numel, P, n)
        model.h2d[fetched] += fetch * x
        out = gpu_step_out_bytes(g.param_bytes, g.param_numel, stages.state_bytes, M)
        # sharded: the gathered weights whole and a share of the rest; with sharded host weights, a share of all
        back = (piece(out, g.param_numel, P, n) if model.zero3 else g.param_bytes + piece(out - g.param_bytes, g.param_numel, P, n)) \
            if n > 1 else out - st.copy
        model.d2h[L.fw(s)] += back * x
        opt_bytes = piece(gpu_step_bytes(g.param_bytes, g.param_numel, stages.state_bytes, M, g.largest_numel),
                          g.param_numel, P, n)
        for t in {L.fw(max(s - 1, 0)), L.fw(s)}:
            model.mem[t] = model.mem[t] + opt_bytes * x
        if s >= 2:  # fetched a window earlier: the whole prefetch moves, both slots live longer
            model.h2d[L.fw(s - 1)] -= (fetch + g.param_bytes) * ahead
            model.h2d[L.fw(s - 2)] += (fetch + g.param_bytes) * ahead
            model.mem[L.fw(s - 2)] = model.mem[L.fw(s - 2)] + (opt_bytes + g.param_bytes + st.staging) * ahead
        model.serial = model.serial + x * st.step_s
        # the step runs on the compute stream before its forward, once its fetch has landed:
        # fetched one window ahead, it trails the fetch inside that window; two ahead, the
        # fetch is in by then. Transfers run beside it as beside compute (NOTE: [GPU-step lag] in formulation.py)
        model.lag[fetched] += (x - ahead) * st.step_s
        # and it waits for the window's write-backs (NOTE: [GPU-step lag] in formulation.py)
        model.dlag[fetched] += x * st.step_s
        model.cap[fetched] += x * st.step_s

    def tail_bytes(self, model):
        # NOTE: [Flushed updates] in footprint.py: one such stage's update applied between steps
        if model.n > 1:
            return
        flush = model.m.add_var("flush", lb=0.0)  # in units of `unit` bytes
        model.floors.append(flush)
        for s in range(len(model.st)):
            model.m += flush >= (flush_bytes(model.st, s) / model.unit) * self.indicator(model.v, s)
        model.tail = model.tail + flush * model.unit

    def buffers(self, lo, s):
        super().buffers(lo, s)
        g = lo.stages[s]
        lo.buffer(f"opt:{s}", "gpu", lo.share(gpu_step_bytes(g.param_bytes, g.param_numel, lo.stages.state_bytes, lo.M,
                                                             g.largest_numel), s))

    def prefetch(self, lo, s):
        g = lo.stages[s]
        lo.emit(Stream.H2D, Kind.PREFETCH, s, reads=(f"host:grad:{s}",), allocs=(f"opt:{s}", f"w:{s}"),
                moved=lo.share(gpu_step_state_bytes(g.param_numel, lo.stages.state_bytes, lo.M) + g.param_bytes, s))
        lo.emit(Stream.H2D, Kind.FREE, s, frees=(f"host:grad:{s}",))

    def before_forward(self, lo, s):
        lo.stepped[s] = lo.emit(Stream.COMPUTE, Kind.OPT_STEP, s, reads=(f"opt:{s}", f"w:{s}"), device="gpu")
        if lo.n > 1:
            lo.gather(s, f"w:{s}", after=(lo.stepped[s],))

    def write_back(self, lo, s):
        # the new weights first: the slot's FREE after this forward waits for this copy only
        moved = lo.share(lo.weights_bytes(s), s) if lo.zero3 else lo.weights_bytes(s)  # NOTE: [Sharded host weights]
        lo.emit(Stream.D2H, Kind.OFFLOAD, s, reads=(f"w:{s}",), after=(lo.stepped[s],), moved=moved)
        lo.emit(Stream.D2H, Kind.OFFLOAD, s, reads=(f"opt:{s}",), after=(lo.stepped[s],), moved=lo.states_out(s))

    def after_forward(self, lo, s):  # compute waits here for the write-back, if late
        lo.emit(Stream.COMPUTE, Kind.FREE, s, frees=(f"opt:{s}",))
