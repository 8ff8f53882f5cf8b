"""The allocator reserve a plan leaves inside its budget: the profile's, or room for the step's largest
single allocation where that is more (NOTE: [Room for the largest block])."""

from __future__ import annotations

from dataclasses import replace

from lazytrain.hardware import Hardware
from lazytrain.ir.graph import Graph, largest_value_bytes
from lazytrain.ir.stages import Stages

# NOTE: [Room for the largest block] The caching allocator (expandable segments) serves a request
# from a free block of its stream's pool at least as large, or maps new pages at the pool's end while
# its reserved bytes stay under the cap. Failing both, it retries: it frees every cached block (a
# device-wide sync) and maps again (NOTE: [Allocator retries] in train/report.py). So what a plan
# leaves under its cap must hold its largest allocation, whatever holes the pool has then. The fixed
# reserve (NOTE: [Allocator reserve] in hardware/__init__.py) held them where tensors were small
# beside it. The 7B at 1 x 65,536 with 36 GB host makes five 2.31 GiB tensors in each fused MLP
# backward. With the 2 GiB reserve every retry came at one of them (`bench/fidelity.py run --trace`,
# H100, 2026-12-05: eight in one step, each giving back 4.0-6.2 GiB of pages), 6-8 retries a step,
# and the step ran at 14.5 s against 12.9 priced (16.7-17.3 s on the H200 the same day). Compiled
# with a 4 GiB reserve it retried 0-1 times a step and ran at 12.7 s. The H200 fidelity rows at
# their cap (7649af6, 2026-12-05) agree: those that retried at a cost left the largest allocation
# less than nothing beyond it (the 65,536 row -0.31 GiB; the 32B with fp32 masters -0.90, its 2.90
# GiB fp32 embedding gradient), while every row that left 0.55 GiB or more beyond it retried 0-2
# times a step at no measured cost (the 7B with 44 GB host 0.84, the 14B at 40 GiB 0.55, the 32B
# with 104 GB host 0.55). So the reserve is at least the largest allocation and `LARGEST_MARGIN`,
# under the least those rows had. The 65,536 row's plan under this rule (2.81 GiB) ran at
# 12.74-12.80 s against 12.86 priced with no retry in a timed step (H100, 2026-12-06). Rows whose
# largest allocation is 1.5 GiB or less keep the 2 GiB reserve and their plans. The plan's
# own buffers (weight and optimizer slots, NOTE: [Slots] in runtime/store.py) are not counted: the
# traced retries all came at operators' tensors, and a slot's size recurs layer after layer.
LARGEST_MARGIN = 1 << 29


def largest_allocation(graph: Graph, stages: Stages) -> int:
    """The largest single tensor a step makes on the device: an operator's output (its gradient in
    backward is as large; a chunked stage makes its per-batch values one chunk at a time), or the
    largest parameter's gradient at the masters' precision (fp32 masters' gradients are converted
    before their step, NOTE: [Step allocations] in runtime/stepping.py)."""
    out = 0
    for g in stages:
        whole = set(g.whole)
        for name in g.nodes:
            n = largest_value_bytes(graph[name].value) if name in graph else 0
            out = max(out, n if g.chunks <= 1 or name in whole else -(-n // g.chunks))
    numel = max([stages.largest_shared_numel] + [g.largest_numel for g in stages])
    return max(out, numel * stages.master_bytes)


def with_reserve(hw: Hardware, graph: Graph, stages: Stages) -> Hardware:
    """`hw` with room under the cap for the step's largest allocation (NOTE: [Room for the largest
    block]); a profile without a reserve (the CPU's: no caching allocator) keeps none."""
    if hw.allocator_reserve_bytes <= 0:
        return hw
    need = largest_allocation(graph, stages) + LARGEST_MARGIN
    return replace(hw, allocator_reserve_bytes=need) if need > hw.allocator_reserve_bytes else hw
