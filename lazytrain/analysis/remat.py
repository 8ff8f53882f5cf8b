"""What a stage's recompute before its backward may leave uncomputed.

Needs: a `Graph`, one stage's nodes, the graph's users and `saved` (what backward formulas read).
Guarantees: `skips(...)` names the stage's `linear` nodes whose value no backward formula of the
stage reads, directly or through anything computed from it. Their backward reads only their input
and weight, so a recompute that runs them as `grad_only_linear` (zeros forward, exact backward)
gives the same gradients.

NOTE: [Skipped recompute]
A recomputed stage runs its forward again at B(s) only to rebuild what autograd needs. Some of that
forward is needed by nothing: in a transformer layer, `down_proj`'s output is only added to the
residual to form the layer's output, and neither the add's nor the next layer's backward reads
it. Checkpointing that reruns the whole layer spends 29% of a Qwen2.5-7B layer's FLOPs there. A
stage with skips gets a `remat` flag: with it, those linears return zeros and keep their input
and weight for an exact backward (`runtime/remat.py`). The forward, and the recompute of dropped
outputs (whose values later stages read), run the full function. The cost model charges a
recompute before backward at `Stage.remat_s`, its forward time less the skipped nodes.

The proof is conservative in the way `saved` is: an operator outside its table counts as reading
every input and its result, which blocks any skip upstream of it.
"""

from __future__ import annotations

from lazytrain.ir.graph import Graph

SKIPPABLE = ("aten.linear.default",)  # operators `runtime/remat.py` can run backward-only


def skips(graph: Graph, names: tuple[str, ...], users: dict[str, list[str]],
          kept: dict[str, set[str]]) -> tuple[str, ...]:
    local = set(names)
    # values some backward formula of this stage reads (later stages read their own leaf copies)
    read = {v for v, by in kept.items() if v in local and not by.isdisjoint(local)}
    out = []
    for name in names:
        if graph[name].target not in SKIPPABLE:
            continue
        tainted, todo = set(), [name]  # everything computed from a zeros stand-in is wrong
        while todo:
            v = todo.pop()
            if v in local and v not in tainted:
                tainted.add(v)
                todo.extend(users.get(v, ()))
        if tainted.isdisjoint(read):
            out.append(name)
    return tuple(out)
