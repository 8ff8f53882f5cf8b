"""Pass `liveness`: where each tensor is last used, with views keeping their base storage alive.

Needs: a `Graph` and its `costs` (for which nodes are views). Guarantees: `last_use[n]` is the
position of the last node that reads `n`'s storage (through any chain of views); the loss is live
to the end (`len(graph)`).

    a = mul(x, x); v = view(a); b = add(v, 1)   ->  last_use[a] = position of b
"""

from __future__ import annotations

from lazytrain.ir.graph import Graph
from lazytrain.passes.costs import NodeCost


def storage_roots(graph: Graph, costs: dict[str, NodeCost]) -> dict[str, str]:
    """Node -> the node that owns its storage (itself unless it is a view)."""
    root: dict[str, str] = {}
    for node in graph:
        c = costs.get(node.name)
        src = next(node.inputs(), None) if c is not None and c.alias else None
        root[node.name] = root[src] if src is not None else node.name
    return root


def liveness(graph: Graph, costs: dict[str, NodeCost]) -> dict[str, int]:
    root = storage_roots(graph, costs)
    last = {n.name: i for i, n in enumerate(graph)}
    for i, node in enumerate(graph):
        for name in node.inputs():
            last[root[name]] = max(last[root[name]], i)
    last[root[graph.output]] = len(graph)
    return last
