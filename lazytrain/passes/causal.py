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
(then it is the same tensor every step), and the mask must equal the lower-triangular causal mask
in every broadcast slice (bool: True on and below the diagonal; float: 0 there and -inf above),
with as many queries as keys. A mask that depends on the batch (padding, packed documents), or any
other mask, is left alone. The proof reads the mask as intervals of keys per query row, computed
from the O(S) vectors it is built from (NOTE: [Masks by rows of intervals] in analysis/masks.py):
O(S log S), never the [S, S] mask. A mask built otherwise is evaluated on the CPU with the same
ATen operators: whole, or, past `EVAL_LIMIT` (1 x 16384 tokens already is), a block of query rows
at a time, where every large value on its way is elementwise over [..., queries, keys]. At 1 x
65536 a Qwen2.5 mask is 4 GiB of booleans; unproven, it reached attention as a tensor that made an
8 GiB bias in every layer and kept attention off the flash kernel.
"""

from __future__ import annotations

import dataclasses

import torch

from lazytrain.analysis.masks import Unsupported, is_causal_rows, mask_rows
from lazytrain.ir.evaluate import decode, evaluate, operator
from lazytrain.ir.graph import Graph, Node, OpKind, Sym, value_bytes

SDPA = "aten.scaled_dot_product_attention.default"
SDPA_SCHEMA = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal")
EVAL_LIMIT = 1 << 30  # bytes: larger constant masks are not evaluated (and not rewritten)


def causal(graph: Graph) -> Graph:
    rewritten: dict[str, Node] = {}
    cache: dict[str, bool] = {}  # mask name -> proven causal
    masks: set[str] = set()  # the masks no longer read
    for node in graph.of(OpKind.CALL):
        if node.target != SDPA:
            continue
        args = dict(zip(SDPA_SCHEMA, node.args)) | dict(node.kwargs)
        mask = args.get("attn_mask")
        if not isinstance(mask, Sym) or args.get("is_causal", False):
            continue
        q, k = graph[args["query"].value].spec, graph[args["key"].value].spec
        if mask.value not in cache:
            cache[mask.value] = _proven(graph, mask.value, q.shape[-2], k.shape[-2])
        if not cache[mask.value]:
            continue
        masks.add(mask.value)
        kwargs = tuple((n, v) for n, v in node.kwargs if n not in ("attn_mask", "is_causal"))
        rewritten[node.name] = dataclasses.replace(
            node, args=node.args[:3], kwargs=(("dropout_p", args.get("dropout_p", 0.0)), ("is_causal", True)) + kwargs)
    if not rewritten:
        return graph
    nodes = [rewritten.get(n.name, n) for n in graph]
    producers = {n.name for m in masks for n in _ancestors(graph, m)}
    return dataclasses.replace(graph, nodes=tuple(without_dead(nodes, graph.output, producers)))


def _proven(graph: Graph, name: str, n_queries: int, n_keys: int) -> bool:
    """Whether the mask `name` equals the causal mask: by rows of intervals (NOTE: [Masks by rows of
    intervals] in analysis/masks.py), else by evaluating it, whole or a block of rows at a time."""
    nodes = _producers(graph, name)
    if nodes is None or n_queries != n_keys:
        return False
    try:
        return is_causal_rows(mask_rows(graph, nodes, name, n_queries, n_keys, _evaluate), n_keys)
    except Unsupported:
        pass
    except Exception:  # an op that will not run on the CPU: evaluating it fails the same way
        return False
    value = _constant(graph, name)
    return _is_causal(value, n_queries, n_keys) if value is not None else _causal_by_rows(graph, name, n_queries, n_keys)


def _ancestors(graph: Graph, name: str) -> list[Node]:
    """`name` and everything it reads, in graph order."""
    seen, stack = set(), [name]
    while stack:
        n = stack.pop()
        if n not in seen:
            seen.add(n)
            stack.extend(graph[n].inputs())
    return [n for n in graph if n.name in seen]


def _producers(graph: Graph, name: str) -> list[Node] | None:
    """`name` and everything it reads, in graph order, when none is an input, parameter or buffer
    (then its value is the same every step); else None."""
    nodes = _ancestors(graph, name)
    return None if any(n.op not in (OpKind.CALL, OpKind.GETITEM) for n in nodes) else nodes


def _constant(graph: Graph, name: str) -> torch.Tensor | None:
    """The value of `name` when it reads no input, parameter or buffer (else None), on the CPU."""
    nodes = _producers(graph, name)
    if nodes is None or sum(value_bytes(n.value) for n in nodes) > EVAL_LIMIT:
        return None
    env: dict[str, object] = {}
    try:
        for n in nodes:
            _evaluate(n, env)
    except Exception:  # an op that will not run on the CPU: no proof, no rewrite
        return None
    out = env[name]
    return out if isinstance(out, torch.Tensor) else None


# Operators a large mask may be built with, evaluated a block of query rows at a time: each
# output element depends on the same element of its (broadcast) inputs alone.
_ELEMENTWISE = {f"aten.{op}.{kind}" for op in ("le", "lt", "ge", "gt", "eq", "ne") for kind in ("Tensor", "Scalar")} | {
    "aten.__and__.Tensor", "aten.__or__.Tensor", "aten.bitwise_and.Tensor", "aten.bitwise_or.Tensor",
    "aten.logical_and.default", "aten.logical_or.default", "aten.logical_not.default", "aten.bitwise_not.default",
    "aten.to.dtype", "aten.to.dtype_layout", "aten._to_copy.default", "aten.expand.default"} | {
    f"aten.{op}.{kind}" for op in ("add", "sub") for kind in ("Tensor", "Scalar")}
BLOCK_BYTES = 256 << 20  # a block of rows of each large value, during `_causal_by_rows`


def _causal_by_rows(graph: Graph, name: str, n_queries: int, n_keys: int) -> bool:
    """`_is_causal` for a constant mask too large to evaluate whole (NOTE in the module docstring:
    a proof, not a pattern): its small ancestors are evaluated whole, and its large ones, which
    must be elementwise over [..., queries, keys] (`_ELEMENTWISE`), a block of query rows at a time,
    each block checked against the same rows of the causal mask. Anything else: no proof."""
    nodes = _producers(graph, name)
    if nodes is None or n_queries != n_keys:
        return False
    large = {n.name for n in nodes if value_bytes(n.value) > EVAL_LIMIT // 16}
    for n in nodes:
        shape = getattr(n.value, "shape", None)
        if n.name in large and (n.target not in _ELEMENTWISE or shape is None or len(shape) < 2
                                or tuple(shape[-2:]) != (n_queries, n_keys)):
            return False
        if n.name not in large and any(i in large for i in n.inputs()):
            return False  # a small value computed from a large one: not elementwise
    small = [n for n in nodes if n.name not in large]
    if sum(value_bytes(n.value) for n in small) > EVAL_LIMIT:
        return False
    env: dict[str, object] = {}
    try:
        for n in small:
            _evaluate(n, env)
        rows = max(1, BLOCK_BYTES // max(1, value_bytes(graph[name].value) // n_queries))
        for r0 in range(0, n_queries, rows):
            r1 = min(n_queries, r0 + rows)
            block = dict(env)
            for n in nodes:
                if n.name in large:
                    _evaluate(n, block, rows=(r0, r1, n_queries))
            got = block[name]
            below = torch.arange(r0, r1)[:, None] >= torch.arange(n_keys)[None, :]
            if not isinstance(got, torch.Tensor) or got.dtype != torch.bool or not bool((got == below).all()):
                return False
    except Exception:  # an op that will not run on the CPU: no proof, no rewrite
        return False
    return True


def _evaluate(n: Node, env: dict, rows: tuple[int, int, int] | None = None) -> None:
    """`n`'s value on the CPU into `env`. With `rows` (r0, r1, n): only query rows r0:r1 of a large
    elementwise value: inputs whose second-to-last dimension is n are cut to those rows, and an
    expand's target size says r1 - r0 there."""
    if rows is None or n.op is OpKind.GETITEM:
        evaluate(n, env)
        return
    args = decode(n.args, env)
    r0, r1, total = rows
    args = [a[..., r0:r1, :] if isinstance(a, torch.Tensor) and a.dim() >= 2 and a.shape[-2] == total
            and a.shape[-2] != 1 else a for a in args]
    if n.target == "aten.expand.default":
        size = list(args[1])
        size[-2] = r1 - r0
        args[1] = size
    env[n.name] = operator(n.target)(*args, **{k: decode(v, env) for k, v in n.kwargs})


def _is_causal(mask: torch.Tensor | None, n_queries: int, n_keys: int) -> bool:
    if mask is None or mask.dim() < 2 or n_queries != n_keys or tuple(mask.shape[-2:]) != (n_queries, n_keys):
        return False
    below = torch.ones(n_queries, n_keys, dtype=torch.bool).tril()
    if mask.dtype == torch.bool:
        return bool((mask == below).all())
    if mask.is_floating_point():
        return bool((mask[..., below] == 0).all()) and bool((mask[..., ~below] == float("-inf")).all())
    return False


def without_dead(nodes: list[Node], output: str, candidates: set[str]) -> list[Node]:
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
