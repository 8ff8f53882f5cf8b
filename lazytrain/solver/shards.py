"""Bytes and seconds of sharded data-parallel state (NOTE: [Sharded state] in runtime/sharding.py),
shared by the step model (pass `solve`) and pass `lower`.

With `Stages.sharded`, each of the `world_size` ranks keeps 1/N of every stage's master weights,
optimizer states and reduced gradients. Every parameter is cut along its flattened elements into N
pieces of ceil(numel / N) (torch.chunk's cut, the last ones shorter or empty), so a rank's share of
a stage is at most its numel / N plus one element per parameter; the counts below round up by that.
With 8-bit states the pieces are whole quantisation blocks (ceil(numel / N) rounded up to
`QUANT_BLOCK`), so a rank's share is at most numel / N plus a block per parameter: `sharding` says
so, and the counts round up by that instead. (The 8-bit states' bytes per parameter, `STATE_BYTES`,
hold the absmax vectors, one fp32 per block: a rank's share of them is its blocks'.)
Collectives run over flat buffers of N equal regions (each rank's pieces, padded): the
reduce-scatter's input and the all-gather's output hold the whole stage in the compute dtype.
Their time is the buffer's bytes over the link's algorithm bandwidth (`Hardware.link_bandwidth`).
"""

from __future__ import annotations

import math

from lazytrain.hardware import Hardware
from lazytrain.ir.stages import STATE_BYTES
from lazytrain.sizes import QUANT_BLOCK
from lazytrain.solver.footprint import (
    deferred_step_s,
    fixed_bytes,
    gpu_step_s,
    resident_bytes,
    resident_grad_bytes,
    shared_step_bytes,
    step_bytes,
)


class Shards(int):
    """The number of ranks state is sharded over, which also knows the elements a rank's piece of a
    parameter is whole blocks of (`align`: 1, or `QUANT_BLOCK` with 8-bit states)."""

    align: int

    def __new__(cls, n: int, align: int = 1):
        out = super().__new__(cls, n)
        out.align = align
        return out


def sharding(stages) -> Shards:
    """The ranks state is sharded over: N with sharded state, else 1 (replicated or one process)."""
    if not (stages.sharded and stages.world_size > 1):
        return Shards(1)
    return Shards(stages.world_size, QUANT_BLOCK if stages.state_bytes == STATE_BYTES["8bit"] else 1)


def gathers_weights(stages) -> bool:
    """Each rank's host keeps 1/N of every streamed stage's compute-dtype weights and every prefetch
    all-gathers them (NOTE: [Sharded host weights] in runtime/host_weights.py)."""
    return stages.weights_sharded and sharding(stages) > 1


def piece(nbytes: float, numel: int, params: int, n: int) -> int:
    """A rank's share of `nbytes` spread evenly over `numel` elements of `params` tensors: its 1/n,
    and a piece's rounding up (an element, or a block: `Shards.align`) per tensor."""
    if n == 1:
        return int(math.ceil(nbytes))
    per = nbytes / max(1, numel)
    return int(math.ceil(per * (numel / n + params * getattr(n, "align", 1))))


def shared_step_s(stages, hw: Hardware) -> float:
    """The shared (tied) weights' step after backward, on this rank's piece of them: the step model's
    and `lower`'s one price."""
    params = len(stages.shared_params)
    numel = piece(stages.shared_numel, stages.shared_numel, params, sharding(stages))
    return deferred_step_s(stages, gpu_step_s(numel, params, hw, stages.master_bytes, stages.state_bytes), params, hw)


def flat_bytes(param_bytes: int, numel: int, params: int, n: int) -> int:
    """The N-region flat buffer of a stage's collective, in the compute dtype."""
    return n * piece(param_bytes, numel, params, n)


def comm_s(param_bytes: int, hw: Hardware, n: int) -> float:
    """One reduce-scatter or all-gather of a stage (its bytes in the compute dtype) on the link."""
    return param_bytes / hw.link_bandwidth if n > 1 else 0.0


def allreduce_s(param_bytes: int, hw: Hardware, world: int) -> float:
    """A replicated run's all-reduce of a stage's gradients (its bytes in the compute dtype): a
    reduce-scatter and an all-gather on the link; 0 where the profile has no measured link (NOTE:
    [Replicated all-reduce] in step_model.py)."""
    return 2 * param_bytes / hw.link_bandwidth if world > 1 and hw.link_bandwidth > 0 else 0.0


def resident_sharded_bytes(param_bytes: int, numel: int, params: int, state_bytes: float, master: int, n: int) -> int:
    """A sharded resident stage on the GPU: the full compute-dtype weights, and its shard of the
    optimizer states and (in mixed precision) the master weights."""
    mixed = master * numel if param_bytes != master * numel else 0
    return param_bytes + piece(state_bytes * numel + mixed, numel, params, n)


def shard_grad_bytes(param_bytes: int, numel: int, params: int, master: int, n: int) -> int:
    """A rank's reduced gradients of a stage: its shard in the compute dtype, and in mixed precision
    also the master-dtype copy the step reads."""
    extra = resident_grad_bytes(param_bytes, numel, master) if param_bytes != master * numel else 0
    return piece(param_bytes + extra, numel, params, n)


def comm_workspace(param_bytes: int, numel: int, params: int, n: int) -> int:
    """A collective's transient buffers: the flat N-region buffer and the rank's own region."""
    return flat_bytes(param_bytes, numel, params, n) + piece(param_bytes, numel, params, n)


def sharded_step_bytes(stages, s: int, n: int) -> int:
    """A resident stage's step on its shard: `step_bytes` of a 1/N stage."""
    g = stages[s]
    return piece(step_bytes(stages, s), g.param_numel, len(g.params), n)


def host_shard_bytes(param_bytes: int, numel: int, params: int, state_bytes: float, master: int, n: int) -> int:
    """Host memory a sharded streamed stage adds beyond its full weights in the compute dtype (the
    model's own parameters, which the prefetches read): its shards of the master (in mixed
    precision), the optimizer states, and the gradient as offloaded (compute dtype) and as a host
    step reads it (master dtype: a GPU step subtracts it)."""
    mixed = master * numel if param_bytes != master * numel else 0
    return piece(mixed + state_bytes * numel + param_bytes + master * numel, numel, params, n)


def sharded_tail(stages, hw: Hardware, resident, steps, n: int):
    """GPU bytes after backward with sharded state (pass `lower`'s tail): resident stages' weights,
    state shards and gradient shards, the shared weights' full gradients and shard, stage 0's full
    gradients and shard, the largest collective's buffers, and `steps` (the deferred steps' most).
    `resident`: per stage 1 or 0, numbers or solver variables alike."""
    M = stages.master_bytes
    P0 = len(stages.shared_params)
    out = fixed_bytes(stages) + hw.runtime_bytes + steps - _shared_unsharded(stages) + resident_sharded_bytes(
        stages.shared_bytes, stages.shared_numel, P0, stages.state_bytes, M, n)
    if stages.shared_numel:
        out += stages.shared_bytes + shard_grad_bytes(stages.shared_bytes, stages.shared_numel, P0, M, n)
    g0 = stages[0]
    ws = max(comm_workspace(g0.param_bytes, g0.param_numel, len(g0.params), n),
             comm_workspace(stages.shared_bytes, stages.shared_numel, P0, n))
    out += g0.param_bytes + shard_grad_bytes(g0.param_bytes, g0.param_numel, len(g0.params), M, n) + ws
    for g, r in zip(stages, resident):
        P = len(g.params)
        out = out + r * (resident_sharded_bytes(g.param_bytes, g.param_numel, P, stages.state_bytes, M, n)
                         + shard_grad_bytes(g.param_bytes, g.param_numel, P, M, n))
    return out


def _shared_unsharded(stages) -> int:
    return resident_bytes(stages.shared_bytes, stages.shared_numel, stages.state_bytes, stages.master_bytes)


def sharded_deferred_bytes(stages, resident, n: int) -> int:
    """`deferred_step_bytes` of shards: the most any resident (or shared) step on its shard holds."""
    shared = piece(shared_step_bytes(stages), stages.shared_numel, len(stages.shared_params), n)
    return max([shared] + [sharded_step_bytes(stages, s, n) for s, r in enumerate(resident) if r])
