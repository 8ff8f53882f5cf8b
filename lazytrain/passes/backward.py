"""The memory of a stage's backward: autograd's walk replayed over the stage's nodes.

Needs: a `Graph`, its `costs` (views), the values that carry gradient and what autograd saves
(pass `saved`). Guarantees: `backward_peak` is the most memory the stage's backward holds at once
of its saved values and of the gradients of its own intermediates, with the running operator's
own workspace (`memory.backward_internal_bytes`); not the gradients of its inputs, outputs or parameters, which the step model counts
as buffers of their own (`grad:`, `g:` and resident gradients).

NOTE: [Backward memory]
Autograd runs a stage's backward node by node in reverse. At each node the gradient of its result
is live (made by the node's consumers), the gradients of its inputs are made beside it, and then
the result's gradient and whatever only this node saved are freed. A view passes its gradient
through without a copy. The step model used to bound this by everything saved plus the forward's
live peak; on the H200, for a Qwen2.5-7B layer at 32 x 1024 tokens recomputed in its backward,
that bound was 11.2 GiB where the allocator saw 9.25 GiB, and every backward window of a 24 GiB
plan stood 2 GiB over the measured one (the fidelity trace, 2026-11-30).
"""

from __future__ import annotations

from lazytrain.ir.graph import Graph, OpKind, value_bytes
from lazytrain.passes.costs import NodeCost
from lazytrain.passes.memory import backward_internal_bytes
from lazytrain.passes.saved import saved_internal


def backward_peak(graph: Graph, names: tuple[str, ...], costs: dict[str, NodeCost], rg: frozenset[str],
                  kept: dict[str, set[str]], saved_values: set[str], outputs: tuple[str, ...],
                  accumulating: set[str] = frozenset()) -> int:
    inside = set(names)

    def base(name: str) -> str:
        while name in costs and costs[name].alias:
            src = next(graph[name].inputs(), None)
            if src is None:
                break
            name = src
        return name

    # saved values live until the last node of this stage that reads them has run backward
    saved = {v: value_bytes(graph[v].value) for v in saved_values}
    readers = {v: set(kept.get(v, ())) & inside for v in saved_values}
    internal = {n: saved_internal(graph[n], graph) for n in names}
    held = sum(saved.values()) + sum(internal.values())
    grads: dict[str, int] = {}  # base value -> bytes of its gradient
    ours = {base(n) for n in names} - {base(o) for o in outputs}
    peak = held
    for n in reversed(names):
        node = graph[n]
        if node.op is not OpKind.CALL or n not in rg or costs[n].alias:
            continue
        new = {}
        for i in node.inputs():
            b = base(i)
            if i in rg and b in inside and b in ours and b not in grads and graph[b].op is not OpKind.PARAM:
                new[b] = value_bytes(graph[b].value)
        # a parameter whose gradient exists already (a tied weight a later stage read) gets this
        # node's part as a tensor of its own, added in after
        adding = sum(graph[i].spec.nbytes for i in set(node.inputs()) & accumulating)
        peak = max(peak, held + sum(grads.values()) + sum(new.values()) + backward_internal_bytes(node, graph) + adding)
        grads.update(new)
        grads.pop(base(n), None)
        held -= internal.pop(n, 0)
        for v in list(readers):
            readers[v].discard(n)
            if not readers[v]:
                held -= saved.pop(v)
                del readers[v]
    return peak
