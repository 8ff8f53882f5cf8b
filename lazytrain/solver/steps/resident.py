"""Kind "resident": weights, gradients, master and states on the device, stepped there as the
stage's backward ends (NOTE: [Resident steps] in solver/footprint.py), or after backward with exact
clipping; its gradients freed at its step where the plan says so (NOTE: [Resident gradients freed at
their step] in solver/footprint.py). With sharded state its step, reduce-scatter and all-gather are
the walks' sharded paths (solver/step_model.py `_sharded`, passes/lower.py `reduced`)."""

from __future__ import annotations

from lazytrain.ir.events import Kind, Stream
from lazytrain.solver.footprint import (
    cast_s,
    deferred_step_s,
    resident_bytes,
    resident_grad_bytes,
    step_bytes,
)
from lazytrain.solver.shards import resident_sharded_bytes, shard_grad_bytes
from lazytrain.solver.steps.base import StepRule, rule
from lazytrain.solver.workspace import backward_workspace, chunk_workspace


@rule
class Resident(StepRule):
    kind = "resident"

    @staticmethod
    def indicator(v, s):
        return 1 - v["stream"][s]

    def home(self, model, st, x):
        s, g, L, stages = st.s, st.g, model.L, model.st
        if model.on_stream:  # released as its backward ends
            model.stepped[L.bw(s - 1) if s > 0 else model.TAIL] += x * st.step_s
        else:  # in series with compute (exactly clipped: after backward, as the host issues it)
            model.serial = model.serial + x * deferred_step_s(stages, st.step_s, len(g.params), model.hw)
        if model.n > 1:
            return
        M = stages.master_bytes
        # weights, grads and states for the whole step
        res = resident_bytes(g.param_bytes, g.param_numel, stages.state_bytes, M)
        rgrad = resident_grad_bytes(g.param_bytes, g.param_numel, M)
        # NOTE: [Resident weights cast on use] in footprint.py: no compute copy between uses
        cast = model.v["cast"][s]
        res = res * x - g.param_bytes * cast
        for t in (L.fw(s), L.bw(s)):
            model.mem[t] = model.mem[t] + g.param_bytes * cast
        model.recompute = model.recompute + cast_s(g, model.hw, M) * cast * 2
        model.cap[L.fw(s)] += cast_s(g, model.hw, M) * cast
        model.cap[L.bw(s)] += cast_s(g, model.hw, M) * cast
        T = 2 * len(stages)
        for t in range(T):
            model.mem[t] = model.mem[t] + res
        # NOTE: [Resident gradients freed at their step] in footprint.py: until B(s-2), or the tail
        freed = model.v["free"][s]
        for t in range(L.bw(s), T):
            model.mem[t] = model.mem[t] + rgrad * (x - (freed if t > L.bw(s - 2) else 0))
        if s >= 2:
            model.step_due[L.bw(s - 2)] += freed * st.step_s
        model.tail = model.tail + res + rgrad * (x - freed)
        # its step follows its backward in B(s), once the backward's workspace is gone
        bwd = backward_workspace(g) + (chunk_workspace(stages, s) if g.chunks > 1 else 0)
        model.mem[L.bw(s)] = model.mem[L.bw(s)] + max(0, step_bytes(stages, s) - bwd) * x

    def step_seconds(self, stages, s, p, hw):
        return deferred_step_s(stages, super().step_seconds(stages, s, p, hw), len(stages[s].params), hw)

    def buffers(self, lo, s):
        g, stages, M = lo.stages[s], lo.stages, lo.stages.master_bytes
        P = len(g.params)
        if lo.n > 1:
            home = resident_sharded_bytes(g.param_bytes, g.param_numel, P, stages.state_bytes, M, lo.n)
            lo.buffer(f"res:{s}", "gpu", home, persistent=True)
            lo.buffer(lo.rgrads[s], "gpu", g.param_bytes)
            lo.buffer(f"sg:{s}", "gpu", shard_grad_bytes(g.param_bytes, g.param_numel, P, M, lo.n))
            return
        # NOTE: [Resident weights cast on use] in solver/footprint.py
        cast = g.param_bytes if lo.dec[s].weights.cast_on_use else 0
        lo.buffer(f"res:{s}", "gpu", resident_bytes(g.param_bytes, g.param_numel, stages.state_bytes, M) - cast,
                  persistent=True)
        lo.buffer(lo.rgrads[s], "gpu", resident_grad_bytes(g.param_bytes, g.param_numel, M))
        if cast:
            lo.buffer(f"w:{s}", "gpu", cast)

    def backward_end(self, lo, s):
        if lo.n == 1:  # sharded: stepped on its shard once reduced (`Lowering.reduced`)
            lo.emit(Stream.COMPUTE, Kind.OPT_STEP, s, reads=(f"res:{s}", lo.rgrads[s]), device="gpu",
                    workspace=step_bytes(lo.stages, s))

    def two_later(self, lo, s):
        if s in lo.freed:  # NOTE: [Resident gradients freed at their step] in solver/footprint.py
            lo.emit(Stream.COMPUTE, Kind.FREE, s, frees=(lo.rgrads[s],))
