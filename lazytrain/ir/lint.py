"""The IR verifier: structural invariants every graph must keep (run after capture and in tests)."""

from __future__ import annotations

from lazytrain.errors import PlanError
from lazytrain.ir.graph import Graph, OpKind


def lint(graph: Graph) -> None:
    """Unique names, every reference defined earlier (topological order), one scalar output."""
    seen: set[str] = set()
    for node in graph:
        if node.name in seen:
            raise PlanError(f"IR lint: node name {node.name} appears twice")
        for src in node.inputs():
            if src not in seen:
                raise PlanError(f"IR lint: node {node.name} reads {src} before it is defined")
        if node.op in (OpKind.CALL, OpKind.GETITEM) and not node.name.isidentifier():
            raise PlanError(f"IR lint: node name {node.name!r} is not a Python identifier")
        seen.add(node.name)
    if graph.output not in seen:
        raise PlanError(f"IR lint: output {graph.output} is not a node")
