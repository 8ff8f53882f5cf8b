"""Pass `gqa`: grouped-query attention reads its key and value heads as they are (`enable_gqa=True`).

Needs: a `Graph` after pass `causal`. Guarantees: the same graph, except that each
scaled_dot_product_attention without a mask whose key and value are both repeats of [B, KV, S, D]
tensors to its H = n * KV query heads (transformers' `repeat_kv`: unsqueeze at dimension 2, expand
it to n, reshape to H heads) reads those tensors with `enable_gqa=True`, and the repeats that
nothing else reads are gone.

    unsqueeze_16 = aten.unsqueeze.default(add_5, 2)
    expand_3 = aten.expand.default(unsqueeze_16, (2, 2, 2, 32, 16))
    reshape = aten.reshape.default(expand_3, (2, 4, 32, 16))            # and so for the value
    sdpa = aten.scaled_dot_product_attention.default(add_4, reshape, reshape_1, is_causal=True, scale=0.25)
      -> sdpa = aten.scaled_dot_product_attention.default(add_4, add_5, transpose_2, is_causal=True,
                                                          scale=0.25, enable_gqa=True)

NOTE: [Grouped-query attention unrepeated]
The reshape of an expanded dimension copies (NOTE: [Layouts that decide a copy] in costs.py), and
attention's backward keeps the copies: n times the key and value a layer made. Unrepeated, the
kernel reads each key-value head for its n query heads, and keeps the key and value as they were
made. Its backward still makes the key's and value's gradients at H heads, inside the kernel, and
sums them down (`BACKWARD_RULES` in analysis/memory.py counts them). Measured on the H200
(`bench/gqa_attention.py`, Qwen2.5-7B's 28 query and 4 key-value heads, batch 1, causal, bf16,
2026-12-04, bench/README.md): at 131,072 tokens 793.9 ms forward and backward against 803.6
repeated, 0.89 GiB at the forward's peak against 2.64, 5.53 in backward against 7.03; the plan's
count of a 7B layer there moves alike (its forward's peak 5.25 to 3.06 GiB, its backward 8.22 to
6.82, MLPs and norms in 256 MiB tiles), and its smallest budget at 1 x 131,072 goes from 19.0
GiB to 15.8. Only attention without a mask is rewritten, as transformers' own SDPA path passes
`enable_gqa` only without one: with a mask SDPA may run it on the math kernel, O(S^2) in memory.
"""

from __future__ import annotations

import dataclasses

from lazytrain.ir.graph import Graph, Node, OpKind, Sym, TensorSpec
from lazytrain.passes.causal import SDPA, SDPA_SCHEMA, without_dead

_RESHAPES = ("aten.reshape.default", "aten.view.default", "aten._unsafe_view.default")


def gqa(graph: Graph) -> Graph:
    rewritten: dict[str, Node] = {}
    repeats: set[str] = set()  # the nodes of the repeats no longer read
    for node in graph.of(OpKind.CALL):
        if node.target != SDPA:
            continue
        args = dict(zip(SDPA_SCHEMA, node.args)) | dict(node.kwargs)
        if args.get("attn_mask") is not None or args.get("enable_gqa", False):
            continue
        q = graph[args["query"].value].value
        if not isinstance(q, TensorSpec) or len(q.shape) != 4:
            continue
        found = [_repeated(graph, args[k], q.shape[1]) for k in ("key", "value")]
        if None in found:
            continue
        (key, k_nodes), (value, v_nodes) = found
        repeats.update(k_nodes + v_nodes)
        kwargs = tuple((n, v) for n, v in node.kwargs if n != "enable_gqa") + (("enable_gqa", True),)
        rewritten[node.name] = dataclasses.replace(node, args=(node.args[0], key, value) + tuple(node.args[3:]),
                                                   kwargs=kwargs)
    if not rewritten:
        return graph
    nodes = [rewritten.get(n.name, n) for n in graph]
    return dataclasses.replace(graph, nodes=tuple(without_dead(nodes, graph.output, repeats)))


def _repeated(graph: Graph, arg, heads: int) -> tuple[Sym, list[str]] | None:
    """Where `arg` is `repeat_kv` of a [B, KV, S, D] `x` to `heads` heads: (x, the repeat's nodes);
    else None."""
    if not isinstance(arg, Sym) or arg.kind != "ref":
        return None
    reshape = graph[arg.value]
    if reshape.target not in _RESHAPES or not isinstance(reshape.args[0], Sym):
        return None
    expand = graph[reshape.args[0].value]
    if expand.target != "aten.expand.default" or not isinstance(expand.args[0], Sym):
        return None
    unsqueeze = graph[expand.args[0].value]
    if unsqueeze.target != "aten.unsqueeze.default" or tuple(unsqueeze.args[1:]) != (2,) or \
            not isinstance(unsqueeze.args[0], Sym):
        return None
    x, out = graph[unsqueeze.args[0].value].value, reshape.value
    if not isinstance(x, TensorSpec) or not isinstance(out, TensorSpec) or len(x.shape) != 4:
        return None
    b, kv, s, d = x.shape
    if kv == 0 or heads % kv or heads == kv or out.shape != (b, heads, s, d) or \
            expand.value is None or tuple(expand.value.shape) != (b, kv, heads // kv, s, d):
        return None
    return unsqueeze.args[0], [reshape.name, expand.name, unsqueeze.name]
