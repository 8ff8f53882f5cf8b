"""Pass `fusion`: price the stages whose bodies run compiled by Inductor at their fused time.

Needs: `Stages` after `chunk` (whether a stage is chunked decides whether it fuses), each stage's
eager element-wise time (`elementwise_s`, `elementwise_bwd_s`, from `blocks`), and the hardware's
`fused_elementwise_factor`. Guarantees: with `stages.fused`, every `fusable` stage's forward,
backward and recompute seconds lose (1 - factor) of its element-wise time; chunked and random
stages, and every stage of a plan that is not fused, keep their eager times.

    layer fwd=30.32 ms bwd=59.31 ms (element-wise 7.98 / 13.56), factor 0.40
      -> fwd=25.53 ms bwd=51.17 ms remat=25.53 ms

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
The H200's 0.40 (hardware/h200.json, listed under "estimated": derived from one layer's times with
the cost model's share, not measured as a rate): a Qwen2.5-7B layer, bf16, 32 x 1024 tokens, ran
forward and backward in 84.6 ms eager and 72.4 ms compiled by Inductor (2026-12-02, f503d60). The
cost model prices that layer at 30.32 ms forward and 59.31 ms backward, of which element-wise
nodes 7.98 and 13.56: a share of 21.54 / 89.63 = 0.240 of the eager time, 20.3 ms of the measured
84.6. Compiled, the rest (64.3 ms) is unchanged, so the element-wise work took 72.4 - 64.3 = 8.1 ms:
8.1 / 20.3 = 0.40. The layer's predicted time falls by 0.60 x 21.54 = 12.9 ms (14.4 %, as measured).
End to end, the 7B at 32 x 1024 on the H200 ran fused stage bodies 9-14 % faster than eager
(2026-12-03, b1c75eb): 24 GiB with 8-bit states and bf16 masters 3.796 s a step eager (the plan
predicted 3.741), 3.453 fused; fp32 masters and 32-bit states 4.137 eager, 3.583 fused; no budget
3.375 eager (predicted 3.301), 2.905 fused. The chunked loss stage, transfers and optimizer steps
do not fuse, so whole steps gain less than a layer.
"""

from __future__ import annotations

import dataclasses

from lazytrain.ir.stages import Stages, fusable

FACTOR_FLOOR = 0.05  # the smallest factor a measurement gives (`factor_from_times`)


def fusion(stages: Stages, factor: float) -> Stages:
    """The stages with fusable ones priced fused (NOTE: [Fused stage prices])."""
    if not stages.fused or factor >= 1.0:
        return stages
    saved = 1.0 - factor
    out = []
    for s in stages:
        if fusable(s):
            fwd, bwd = saved * s.elementwise_s, saved * s.elementwise_bwd_s
            s = dataclasses.replace(s, fwd_s=s.fwd_s - fwd, bwd_s=s.bwd_s - bwd, remat_s=max(s.remat_s - fwd, 0.0))
        out.append(s)
    return dataclasses.replace(stages, stages=tuple(out))


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
