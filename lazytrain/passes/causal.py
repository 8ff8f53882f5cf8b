"""Pass `causal`: attention whose mask is a constant causal mask runs as `is_causal=True`.

Needs: a `Graph` (from capture). Guarantees: the same graph, except that each
scaled_dot_product_attention whose `attn_mask` provably equals the causal mask calls it with
`is_causal=True` and no mask, and the nodes that only built that mask are gone.

    expand_2 = aten.expand.default(and_2, [32, -1, 1024, 1024])        # bool, built from aranges
    sdpa = aten.scaled_dot_product_attention.default(q, k, v, expand_2, scale=0.088)
      -> sdpa = aten.scaled_dot_product_attention.default(q, k, v, is_causal=True, scale=0.088)

Why: `torch.export` of a Hugging Face decoder materialises the causal mask as a tensor, and with an
explicit mask attention cannot use the flash kernel. Measured on the H200 at the 7B bench's layer
shape (32 x 28 heads x 1024 x 128, bf16, forward + backward): 6.37 ms with the mask, 2.84 ms causal
(`bench/sdpa_mask.py`).

Proof, not pattern matching: the mask's producers must read no batch input, parameter or buffer
(then it is the same tensor every step); they are evaluated here on the CPU with the same ATen
operators, and the result must equal the lower-triangular causal mask in every broadcast slice
(bool: True on and below the diagonal; float: 0 there and -inf above), with as many queries as
keys. A mask that depends on the batch (padding), or any other mask, is left alone.
"""

from __future__ import annotations

import dataclasses

import torch

from lazytrain.ir.graph import Graph, Node, OpKind, Sym, value_bytes

SDPA = "aten.scaled_dot_product_attention.default"
_SCHEMA = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
EVAL_LIMIT = 1 << 30  # bytes: larger constant masks are not evaluated (and not rewritten)


def causal(graph: Graph) -> Graph:
    rewritten: dict[str, Node] = {}
    cache: dict[str, torch.Tensor | None] = {}  # mask name -> its constant value
    masks: set[str] = set()  # the masks no longer read
    for node in graph.of(OpKind.CALL):
        if node.target != SDPA:
            continue
        args = dict(zip(_SCHEMA, node.args)) | dict(node.kwargs)
        mask = args.get("attn_mask")
        if not isinstance(mask, Sym) or args.get("is_causal", False):
            continue
        if mask.value not in cache:
            cache[mask.value] = _constant(graph, mask.value)
        q, k = graph[args["query"].value].spec, graph[args["key"].value].spec
        if not _is_causal(cache[mask.value], q.shape[-2], k.shape[-2]):
            continue
        masks.add(mask.value)
        kwargs = tuple((n, v) for n, v in node.kwargs if n not in ("attn_mask", "is_causal"))
        rewritten[node.name] = dataclasses.replace(
            node, args=node.args[:3], kwargs=(("dropout_p", args.get("dropout_p", 0.0)), ("is_causal", True)) + kwargs)
    if not rewritten:
        return graph
    nodes = [rewritten.get(n.name, n) for n in graph]
    producers = {n.name for m in masks for n in _ancestors(graph, m)}
    return dataclasses.replace(graph, nodes=tuple(_without_dead(nodes, graph.output, producers)))


def _ancestors(graph: Graph, name: str) -> list[Node]:
    """`name` and everything it reads, in graph order."""
    seen, stack = set(), [name]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(graph[n].inputs())
    return [n for n in graph if n.name in seen]


def _constant(graph: Graph, name: str) -> torch.Tensor | None:
    """The value of `name` when it reads no input, parameter or buffer (else None), on the CPU."""
    nodes = _ancestors(graph, name)
    if any(n.op not in (OpKind.CALL, OpKind.GETITEM) for n in nodes):
        return None
    if sum(value_bytes(n.value) for n in nodes) > EVAL_LIMIT:
        return None
    env: dict[str, object] = {}
    try:
        for n in nodes:
            if n.op is OpKind.GETITEM:
                src, idx = n.args
                env[n.name] = env[src.value][idx]
                continue
            ns, op, overload = n.target.split(".")
            fn = getattr(getattr(getattr(torch.ops, ns), op), overload)
            env[n.name] = fn(*_decode(n.args, env), **{k: _decode(v, env) for k, v in n.kwargs})
    except Exception:  # an op that will not run on the CPU: no proof, no rewrite
        return None
    out = env[name]
    return out if isinstance(out, torch.Tensor) else None


def _decode(arg, env):
    if isinstance(arg, Sym):
        if arg.kind == "ref":
            return env[arg.value]
        if arg.kind == "device":
            return torch.device("cpu")
        return getattr(torch, arg.value)  # dtype, layout, memory_format
    if isinstance(arg, tuple):
        return [_decode(a, env) for a in arg]
    return arg


def _is_causal(mask: torch.Tensor | None, n_queries: int, n_keys: int) -> bool:
    if mask is None or mask.dim() < 2 or n_queries != n_keys or tuple(mask.shape[-2:]) != (n_queries, n_keys):
        return False
    below = torch.ones(n_queries, n_keys, dtype=torch.bool).tril()
    if mask.dtype == torch.bool:
        return bool((mask == below).all())
    if mask.is_floating_point():
        return bool((mask[..., below] == 0).all()) and bool((mask[..., ~below] == float("-inf")).all())
    return False


def _without_dead(nodes: list[Node], output: str, candidates: set[str]) -> list[Node]:
    """Drop the candidates (the removed masks' producers) that nothing reads any more."""
    reads = {n.name: set(n.inputs()) for n in nodes}
    count = {n.name: 0 for n in nodes}
    for n in nodes:
        for src in reads[n.name]:
            count[src] += 1
    count[output] += 1
    dead: set[str] = set()
    for n in reversed(nodes):
        if n.name in candidates and count[n.name] == 0:
            dead.add(n.name)
            for src in reads[n.name]:
                count[src] -= 1
    return [n for n in nodes if n.name not in dead]
