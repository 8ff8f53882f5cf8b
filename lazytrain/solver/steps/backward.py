"""Kind "backward": a streamed stage stepped on the device right after its own backward, on the
gradient there (NOTE: [Backward steps] in solver/step_model.py): master and states come in beside
its backward prefetch at B(s+1), the step runs beside B(s-1), and the new weights, master and
states go back during B(s-1) and B(s-2); states on disk pass through a ring of host buffers (NOTE:
[Backward steps from disk] in solver/disk_model.py), and so may the master (NOTE: [Masters on
disk] there, which with the master tier's other terms stays in the step model). Not the first two
stages or the last, nor with exact clipping or sharded state (`formulation._vars`)."""

from __future__ import annotations

from lazytrain.ir.events import Kind, Stream
from lazytrain.solver.footprint import backward_step_bytes, gpu_step_out_bytes
from lazytrain.solver.steps.base import StreamedRule, rule


@rule
class InBackward(StreamedRule):
    kind = "backward"
    host_grad = False  # stepped on the device where its backward left it (no host copy)

    @staticmethod
    def indicator(v, s):
        return v["bstep"][s]

    def transfers(self, model, st, x):
        s, g, L, stages = st.s, st.g, model.L, model.st
        if 2 <= s < len(stages) - 1:
            mdk, M = model.v["mdisk"][s], stages.master_bytes
            out = gpu_step_out_bytes(g.param_bytes, g.param_numel, stages.state_bytes, M)
            # NOTE: [Backward step twins] in footprint.py
            back_bytes = backward_step_bytes(g.param_bytes, g.param_numel, stages.state_bytes, M, g.largest_numel)
            model.h2d[L.bw(s + 1)] += (out - g.param_bytes) * x  # master and states, beside the weights
            # new weights (not the gradient), master and states, after the step: in B(s-1) or B(s-2)
            model.d2h[L.bw(s - 1)] -= g.param_bytes * x
            model.spread(model.d2h, [L.bw(s - 1), L.bw(s - 2)], (out - st.copy) * x + st.copy * mdk, f"back{s}")
            for t in (L.bw(s + 1), L.bw(s), L.bw(s - 1), L.bw(s - 2)):
                model.mem[t] = model.mem[t] + back_bytes * x
            for t in (L.bw(s - 1), L.bw(s - 2)):  # the weights until written back, the gradient until stepped
                model.mem[t] = model.mem[t] + (g.param_bytes + st.staging) * x - st.staging * mdk
            model.mem[L.bw(s - 2)] = model.mem[L.bw(s - 2)] + g.param_bytes * x
        # on the optimizer stream beside backward's compute
        model.serial = model.serial + x * (st.step_s * model.hw.step_lost(st.g.param_numel))

    def host_bytes(self, model, st, x):
        return -(x * st.g.param_bytes)  # no page-locked gradient buffer

    def buffers(self, lo, s):
        super().buffers(lo, s)
        g = lo.stages[s]
        # NOTE: [Backward step twins] in solver/footprint.py
        lo.buffer(f"opt:{s}", "gpu", backward_step_bytes(g.param_bytes, g.param_numel, lo.stages.state_bytes, lo.M,
                                                        g.largest_numel))

    def backward_prefetch(self, lo, s):  # master and states beside the weights
        lo.emit(Stream.H2D, Kind.PREFETCH, s, allocs=(f"opt:{s}", f"w:{s}"),
                moved=lo.step_out_bytes(s) - lo.stages[s].param_bytes + lo.weights_bytes(s))

    def gradient(self, lo, s):  # beside the next backward: the step, and its write-back
        lo.stepped[s] = lo.emit(Stream.COMPUTE, Kind.OPT_STEP, s, reads=(f"opt:{s}", f"w:{s}", f"g:{s}"), device="gpu")
        lo.emit(Stream.D2H, Kind.OFFLOAD, s, reads=(f"w:{s}",), after=(lo.stepped[s],), moved=lo.weights_bytes(s))
        lo.emit(Stream.D2H, Kind.OFFLOAD, s, reads=(f"opt:{s}",), after=(lo.stepped[s],), moved=lo.states_out(s))

    def after_backward(self, lo, s):
        pass  # its slot goes after its write-back (`two_later`)

    def gradient_landed(self, lo, s):
        pass  # freed after the next backward

    def two_later(self, lo, s):  # stepped and written back beside two backwards
        for buf in (f"g:{s}", f"w:{s}", f"opt:{s}"):
            lo.emit(Stream.COMPUTE, Kind.FREE, s, frees=(buf,))
