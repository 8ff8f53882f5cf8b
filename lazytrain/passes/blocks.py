"""Pass `blocks`: partition the graph into stages (prologue, one per block, epilogue).

Needs: a `Graph` whose nodes carry `block` (from capture), its `costs` and `liveness`.
Guarantees: stages in execution order; every operator node in exactly one stage; every activation
edge goes from an earlier stage to a later one (or raises `TraceError`); parameters owned by the one
stage that reads them, or listed as shared (tied weights) when several do; identical blocks share a
`kind` letter, so a decision solved for one applies to all.

    embedding -> [model.layers.0] -> [model.layers.1] -> norm, lm_head, loss
    stages:  0 prologue | 1 model.layers.0 (A) | 2 model.layers.1 (A) | 3 epilogue

Nodes outside any block are placed by position: before the first block in the prologue, after the
last in the epilogue, between blocks in the preceding block.
"""

from __future__ import annotations

import hashlib

import networkx as nx

from lazytrain.analysis.backward import backward_peak
from lazytrain.analysis.memory import internal_bytes
from lazytrain.analysis.remat import skips
from lazytrain.analysis.saved import saved, saved_internal
from lazytrain.errors import TraceError
from lazytrain.ir.graph import Graph, Node, OpKind, Sym, value_bytes
from lazytrain.ir.stages import STATE_BYTES, Stage, Stages
from lazytrain.passes.costs import NodeCost, requires_grad

_RANDOM_OPS = ("dropout", "bernoulli", "rand", "normal", "multinomial", "uniform")
_ATTENTION_DROPOUT = {  # attention operators whose dropout draws random numbers when its p is not 0
    "aten.scaled_dot_product_attention.default": 4,  # the position of `dropout_p`
    "aten._scaled_dot_product_flash_attention.default": 3,
    "aten._scaled_dot_product_efficient_attention.default": 5,
}


def draws_random(node: Node) -> bool:
    """The node draws from a random-number generator (NOTE: [RNG replay] in runtime/rng.py)."""
    if node.target in _ATTENTION_DROPOUT:
        i = _ATTENTION_DROPOUT[node.target]
        p = node.args[i] if len(node.args) > i else dict(node.kwargs).get("dropout_p", 0.0)
        return p != 0
    return any(r in node.target for r in _RANDOM_OPS)


def _assign(graph: Graph) -> dict[str, str]:
    """Node -> stage name, by block and position."""
    ops = [n for n in graph if n.op in (OpKind.CALL, OpKind.GETITEM)]
    last_block = max((i for i, n in enumerate(ops) if n.block), default=-1)
    where, current = {}, "prologue"
    for i, node in enumerate(ops):
        if node.block:
            current = node.block
        elif i > last_block:
            current = "epilogue"
        where[node.name] = current
    return where


def _kind_key(graph: Graph, names: tuple[str, ...]) -> str:
    """Structure of a stage with names abstracted: equal keys mean identical blocks."""
    local = {n: i for i, n in enumerate(names)}
    outside: dict[str, int] = {}

    def canon(a):
        if isinstance(a, Sym) and a.kind == "ref":
            if a.value in local:
                return f"%{local[a.value]}"
            return f"in{outside.setdefault(a.value, len(outside))}:{graph[a.value].value}"
        if isinstance(a, tuple):
            return tuple(canon(x) for x in a)
        return a

    parts = [(graph[n].target, canon(graph[n].args), canon(tuple(v for _, v in graph[n].kwargs)), str(graph[n].value)) for n in names]
    return hashlib.sha256(repr(parts).encode()).hexdigest()


def blocks(graph: Graph, costs: dict[str, NodeCost], last_use: dict[str, int], optimizer_states: str = "32bit") -> Stages:
    where = _assign(graph)
    order = list(dict.fromkeys(where.values()))
    index = {name: i for i, name in enumerate(order)}
    stage_of = {n: index[s] for n, s in where.items()}
    rg = requires_grad(graph)
    users = graph.users()
    position = {n.name: i for i, n in enumerate(graph)}

    # Check the stage DAG follows execution order (blocks may not interleave).
    dag = nx.DiGraph()
    dag.add_nodes_from(range(len(order)))
    for node in graph:
        if node.name not in stage_of:
            continue
        for src in node.inputs():
            if src in stage_of and stage_of[src] != stage_of[node.name]:
                if stage_of[src] > stage_of[node.name]:
                    raise TraceError(
                        f"node {node.name} in {order[stage_of[node.name]]} reads {src} from the later stage "
                        f"{order[stage_of[src]]}: blocks interleave, so lazytrain cannot stream them in order"
                    )
                dag.add_edge(stage_of[src], stage_of[node.name])
    assert nx.is_directed_acyclic_graph(dag)

    param_users: dict[str, set[int]] = {}
    for node in graph:
        if node.name in stage_of:
            for src in node.inputs():
                if graph[src].op is OpKind.PARAM:
                    param_users.setdefault(src, set()).add(stage_of[node.name])
    shared = tuple(sorted(p for p, s in param_users.items() if len(s) > 1))

    kept = saved(graph, costs, rg)  # NOTE: [Saved activations]
    kinds: dict[str, str] = {}
    stages = []
    for i, name in enumerate(order):
        names = tuple(n for n in stage_of if stage_of[n] == i)
        placeholders = tuple(dict.fromkeys(
            src for n in names for src in graph[n].inputs() if graph[src].op not in (OpKind.CALL, OpKind.GETITEM)))
        inputs = tuple(dict.fromkeys(
            src for n in names for src in graph[n].inputs() if src in stage_of and stage_of[src] < i))
        outputs = tuple(n for n in names if any(u == "<output>" or stage_of.get(u, i) > i for u in users[n]))
        consumers = tuple(sorted({stage_of[u] for n in outputs for u in users[n] if u != "<output>" and stage_of[u] > i}))
        producers = tuple(sorted({stage_of[x] for x in inputs}))
        params = tuple(p for p in placeholders if graph[p].op is OpKind.PARAM and p not in shared)
        owned = [graph[n] for n in names if not costs[n].alias]
        outputs_ = set(outputs)
        saved_values = {n.name for n in owned if n.name in kept and (n.name not in outputs_ or not kept[n.name].isdisjoint(names))}
        saved_inside = sum(saved_internal(graph[n], graph) for n in names)  # operators' own saved buffers
        key = _kind_key(graph, names)
        skipped = skips(graph, names, users, kept)
        kinds.setdefault(key, chr(ord("A") + len(kinds)) if len(kinds) < 26 else f"K{len(kinds)}")
        stages.append(Stage(
            index=i, name=name, kind=kinds[key], nodes=names, params=params, placeholders=placeholders,
            inputs=inputs, outputs=outputs,
            grad_outputs=tuple(o for o in outputs if o in rg and o != graph.output),
            grad_inputs=tuple(x for x in inputs if x in rg),
            consumers=consumers, producers=producers,
            param_numel=sum(graph[p].spec.numel for p in params),
            param_bytes=sum(graph[p].spec.nbytes for p in params),
            saved_bytes=sum(value_bytes(graph[n].value) for n in saved_values) + saved_inside,
            backward_bytes=backward_peak(graph, names, costs, rg, kept, saved_values, outputs,
                                         accumulating={p for p in shared if p in placeholders and max(param_users[p]) > i},
                                         params=frozenset(params)),
            saving_peak_bytes=_peak(graph, names, costs, last_use, position, held=saved_values) + saved_inside,
            peak_bytes=_peak(graph, names, costs, last_use, position),
            internal_bytes=max((internal_bytes(graph[n], graph) for n in names), default=0),
            out_bytes=sum(value_bytes(graph[o].value) for o in outputs),
            grad_out_bytes=sum(value_bytes(graph[o].value) for o in outputs if o in rg and o != graph.output),
            fwd_s=sum(costs[n].time_s for n in names),
            bwd_s=sum(costs[n].bwd_time_s for n in names),
            remat_s=sum(costs[n].time_s for n in names if n not in skipped),
            elementwise_s=sum(costs[n].time_s for n in names if costs[n].elementwise),
            elementwise_bwd_s=sum(costs[n].bwd_time_s for n in names if costs[n].elementwise),
            random=any(draws_random(graph[n]) for n in names),
            largest_numel=max((graph[p].spec.numel for p in params), default=0),
            skips=skipped,
        ))
    fixed = sum(n.spec.nbytes for n in graph.of(OpKind.INPUT, OpKind.BUFFER))
    return Stages(tuple(stages), shared, sum(graph[p].spec.numel for p in shared),
                  sum(graph[p].spec.nbytes for p in shared), STATE_BYTES[optimizer_states], fixed, rg,
                  largest_shared_numel=max((graph[p].spec.numel for p in shared), default=0))


def _peak(graph, names, costs, last_use, position, held=frozenset()) -> int:
    """Largest sum of live non-view intermediates while the stage's forward runs, with the running
    operator's own workspace (NOTE: [Operator workspace] in analysis/memory.py); a tensor stays live until
    its last reader (in this stage or a later one), or to the end if `held` (what autograd saves)."""
    live, peak = {}, 0
    for n in names:
        if not costs[n].alias:
            live[n] = value_bytes(graph[n].value)
        peak = max(peak, sum(live.values()) + internal_bytes(graph[n], graph))
        live = {k: v for k, v in live.items() if last_use[k] > position[n] or k in held}
    return peak
