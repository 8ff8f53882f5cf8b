"""Pass `fusion`: price the stages whose bodies run compiled by Inductor at their fused time.

Needs: `Stages` after `chunk` (a chunked stage fuses at its eager bytes), each stage's
eager element-wise time (`elementwise_s`, `elementwise_bwd_s`, from `blocks`), and the hardware's
`fused_elementwise_factor`. Guarantees: with `stages.fused`, every `fusable` stage's forward,
backward and recompute seconds lose (1 - factor) of its element-wise time and, given the graph,
an unchunked one saves for backward what the compiled body saves (NOTE: [Fused saved activations]
in analysis/fused_saved.py) and its peaks are the compiled body's (NOTE: [Fused transients] in
analysis/fused_transients.py); a chunked loss stage keeps its eager bytes (NOTE: [Compiled loss
slices] in runtime/fused.py); random stages, and every stage of a plan that is not fused, keep
their eager times and bytes.

    layer fwd=30.32 ms bwd=59.31 ms (element-wise 7.98 / 13.56), factor 0.25
      -> fwd=24.34 ms bwd=49.14 ms remat=24.34 ms

NOTE: [Fused stage prices]
The runtime compiles each fusable stage's body with torch.compile (NOTE: [Fused stages] in
runtime/fused.py). Inductor fuses the element-wise work between the matmuls (norms, rotary
embedding, the gated MLP's activation and product, residual adds, dtype conversions, the gradient
sums of backward); the matmuls and fused attention run the same kernels as eager. So a fused
stage's time is its eager time less (1 - factor) of its element-wise time, where element-wise is
the cost model's own split: a node neither a matmul, attention nor a view (`NodeCost.elementwise`).
The factor is the time of that work fused over its eager time, measured per machine by
`lazytrain profile` (`factor_from_times`): one block's forward and backward eager and compiled, the
element-wise share of its eager time taken from the cost model.
The H200's 0.252 (hardware/h200.json) is `lazytrain profile`'s (2026-12-04, 467236f): a 1.5B-shaped
layer at 8 x 1024. It replaced 0.40, derived from one 7B layer's times with the cost model's share:
a Qwen2.5-7B layer, bf16, 32 x 1024 tokens, ran forward and backward in 84.6 ms eager and 72.4 ms
compiled by Inductor (2026-12-02, f503d60); the cost model puts 21.54 of its 89.63 ms in element-wise
nodes (0.240), 20.3 ms of the measured 84.6; compiled, the rest (64.3 ms) is unchanged, so the
element-wise work took 8.1 ms: 8.1 / 20.3 = 0.40. The two shapes differ: with 0.40 the fused 7B
rows of the fidelity table predicted their steps within 4 % and the 1.5B rows 4-9 % slow (2026-12-04).
End to end, the 7B at 32 x 1024 on the H200 ran fused stage bodies 9-14 % faster than eager
(2026-12-03, b1c75eb): 24 GiB with 8-bit states and bf16 masters 3.796 s a step eager (the plan
predicted 3.741), 3.453 fused; fp32 masters and 32-bit states 4.137 eager, 3.583 fused; no budget
3.375 eager (predicted 3.301), 2.905 fused. Transfers and optimizer steps do not fuse, so whole
steps gain less than a layer. Those rows ran the chunked loss stage eager; its slices now compile
too, priced at the same factor (NOTE: [Compiled loss slices] in runtime/fused.py).
"""

from __future__ import annotations

import dataclasses

from lazytrain.analysis.fused_saved import trace
from lazytrain.analysis.fused_transients import HeldFewer, fewer
from lazytrain.ir.graph import Graph
from lazytrain.ir.stages import Stage, Stages, compiled_bytes, fusable

FACTOR_FLOOR = 0.05  # the smallest factor a measurement gives (`factor_from_times`)


def fusion(stages: Stages, factor: float, graph: Graph | None = None) -> Stages:
    """The stages with fusable ones priced fused: their time (NOTE: [Fused stage prices]) and, with
    the `graph`, what they save for backward (NOTE: [Fused saved activations] in analysis/fused_saved.py)."""
    if not stages.fused:
        return stages
    saved = max(0.0, 1.0 - factor)
    memory: dict[str, tuple | None] = {}  # kind -> (saved bytes fewer, HeldFewer), None: eager's bytes
    out = []
    for s in stages:
        if fusable(s):
            fwd, bwd = saved * s.elementwise_s, saved * s.elementwise_bwd_s
            s = dataclasses.replace(s, fwd_s=s.fwd_s - fwd, bwd_s=s.bwd_s - bwd, remat_s=max(s.remat_s - fwd, 0.0))
            if graph is not None and compiled_bytes(s):  # a chunked stage: eager's (NOTE: [Compiled loss slices])
                if s.kind not in memory:
                    memory[s.kind] = _kind_memory(graph, s, stages.requires_grad)
                if memory[s.kind] is not None:
                    s = _compiled_memory(s, *memory[s.kind])
        out.append(s)
    return dataclasses.replace(stages, stages=tuple(out))


def _kind_memory(graph: Graph, s: Stage, requires_grad: frozenset[str]) -> tuple[int, HeldFewer] | None:
    """What a fusable kind's compiled body saves fewer than eager, and holds fewer (NOTE: [Fused
    transients]); None where its body does not trace (eager's bytes stand). A recompute that skips
    work is traced apart, and where that trace fails its window keeps eager's backward bytes."""
    t = trace(graph, s, requires_grad)
    if t is None:
        return None
    remat = trace(graph, s, requires_grad, remat=True) if s.skips else None
    held = fewer(t, remat)
    if s.skips and remat is None:
        held = dataclasses.replace(held, recompute=0)
    return t.eager_saved - t.compiled_saved, held


def _compiled_memory(s: Stage, saved_fewer: int, transients: HeldFewer) -> Stage:
    """`s` with its compiled body's bytes: saving `saved_fewer` bytes less (more, where negative;
    NOTE: [Fused saved activations]) and its peaks lowered by what fusing holds fewer (NOTE: [Fused
    transients]), none below what it saves and outputs."""
    kept = max(0, s.saved_bytes - saved_fewer)
    saving_peak = s.saving_peak_bytes + max(0, -saved_fewer)

    def lowered(peak: int, by: int, floor: int) -> int:  # never above eager's, nor below the floor
        return min(peak, max(floor, peak - by))
    # NOTE: [Workspace the trace cannot see] in analysis/fused_transients.py: a backward is never
    # counted under the compiled body's own peak, eager's count notwithstanding
    backward = max(lowered(s.backward_bytes, transients.backward, kept), transients.backward_peak)
    return dataclasses.replace(
        s, saved_bytes=kept,
        peak_bytes=lowered(s.peak_bytes, transients.forward, s.out_bytes),
        saving_peak_bytes=lowered(saving_peak, transients.saving, kept + s.out_bytes),
        backward_bytes=backward,
        remat_backward_bytes=0 if transients.recompute is None else max(
            lowered(s.backward_bytes, transients.recompute, 0), transients.recompute_peak or 0))


def elementwise_share(stages: Stages) -> float:
    """The share of the fusable stages' eager forward and backward time that their element-wise
    nodes take, over every stage's eager time: what fusing can shorten."""
    total = sum(s.fwd_s + s.bwd_s for s in stages)
    ew = sum(s.elementwise_s + s.elementwise_bwd_s for s in stages if fusable(s))
    return ew / total if total > 0 else 0.0


def factor_from_times(eager_s: float, compiled_s: float, share: float) -> float:
    """The fused element-wise factor from one measurement (NOTE: [Fused stage prices]): `eager_s` and
    `compiled_s` the same forward and backward run eager and compiled, `share` the element-wise share
    of the eager time (`elementwise_share`). What compiling saved is taken off the element-wise part:
    factor = (compiled - (eager - share * eager)) / (share * eager), clamped to [FACTOR_FLOOR, 1]
    (a compile that saved nothing, or one that saved more than the element-wise time, by choosing
    other kernels, which this price does not model). Without element-wise time, 1."""
    ew = share * eager_s
    if not ew > 0:
        return 1.0
    factor = (compiled_s - (eager_s - ew)) / ew
    return min(1.0, max(FACTOR_FLOOR, factor))
