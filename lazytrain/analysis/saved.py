"""What autograd keeps from forward to backward: the values the operators' derivative formulas read.

Needs: a `Graph`, its `costs` (which nodes are views) and the set of values that carry gradient.
Guarantees: `saved(graph, costs, rg)` maps every non-view value some backward formula reads (a
view resolves to the value it views) to the operators whose backward reads it, so a stage keeps
`sum(value_bytes)` of its own such values between its forward and its backward (an output that
only later stages save is already held as the stage's output). Operators outside `SAVES` count as saving every tensor they
read and their result, which over-states memory and never under-states it.

NOTE: [Saved activations]
A stage used to count every intermediate it produced as saved. Most are not: `add` saves nothing,
`linear` only its input, `rsqrt` only its result. For a Qwen2.5-7B layer at 32 x 1024 tokens that
count was 10.8 GiB against about 6.4 GiB autograd keeps, and on the H200 the 7B plans' predicted
peaks stood 7 GiB (24 GiB budget) and 46 GiB (no budget) above the measured ones, which made the
solver recompute layers it had room to keep.
"""

from __future__ import annotations

from typing import Callable

from lazytrain.analysis.memory import mask_bias_bytes
from lazytrain.ir.graph import Graph, OpKind, Sym
from lazytrain.kernels.documents import FLEX_BLOCK
from lazytrain.passes.costs import DOCUMENT_ATTENTION, GATED_MLP, RMS_NORM, NodeCost

# target -> (positions of the tensor arguments saved, given which positions carry gradient;
#            whether the result is saved)
Rule = tuple[Callable[[Callable[[int], bool]], set[int]], bool]


def _nothing(rg) -> set[int]:
    return set()


def _first(rg) -> set[int]:
    return {0}


def _product(a: int, b: int):
    """A product's backward for each factor reads the other one."""
    return lambda rg: ({b} if rg(a) else set()) | ({a} if rg(b) else set())


SAVES: dict[str, Rule] = {
    **{t: (_nothing, False) for t in (
        "aten.add.Tensor", "aten.add.Scalar", "aten.sub.Tensor", "aten.sub.Scalar", "aten.neg.default",
        "aten.cat.default", "aten.stack.default", "aten.to.dtype", "aten.to.dtype_layout", "aten._to_copy.default",
        "aten.contiguous.default", "aten.clone.default", "aten.mean.dim", "aten.mean.default", "aten.sum.dim_IntList",
        "aten.reshape.default",  # one that copies (NOTE: [Layouts that decide a copy] in passes/costs.py)
        "aten.sum.default", "aten.mul.Scalar", "aten.div.Scalar", "aten.type_as.default", "aten.zeros_like.default",
        "aten.ones_like.default", "aten.full_like.default", "aten.arange.default", "aten.arange.start",
    )},
    **{t: (_product(0, 1), False) for t in ("aten.mul.Tensor", "aten.mm.default", "aten.matmul.default",
                                            "aten.bmm.default")},
    "aten.linear.default": (_product(0, 1), False),
    "aten.addmm.default": (_product(1, 2), False),
    "aten.div.Tensor": (lambda rg: {1} | ({0} if rg(1) else set()), False),
    "aten.pow.Tensor_Scalar": (_first, False),
    "aten.silu.default": (_first, False),
    "aten.gelu.default": (_first, False),
    "aten.log.default": (_first, False),
    "aten.sin.default": (_first, False),
    "aten.cos.default": (_first, False),
    **{t: (_nothing, True) for t in (
        "aten.rsqrt.default", "aten.sqrt.default", "aten.exp.default", "aten.tanh.default", "aten.sigmoid.default",
        "aten.relu.default", "aten.softmax.int", "aten._softmax.default", "aten.log_softmax.int",
        "aten._log_softmax.default",
    )},
    "aten.embedding.default": (lambda rg: {1}, False),
    "aten.scaled_dot_product_attention.default": (lambda rg: {0, 1, 2, 3}, True),  # a float mask too
    # query, key, value and position_ids; its output is saved as the o-projection's input already
    # (the `contiguous` between them copies nothing), its lse below (`_document_attention_bytes`)
    DOCUMENT_ATTENTION: (lambda rg: {0, 1, 2, 3}, False),
    GATED_MLP: (lambda rg: {0, 1, 2, 3}, False),  # its input (and weights): each tile is recomputed
    RMS_NORM: (lambda rg: {0, 1}, False),  # its input and weight (NOTE: [Tiled RMSNorm])
    "aten.layer_norm.default": (_first, True),
    "aten.cross_entropy_loss.default": (lambda rg: {0, 1}, False),
}


def _attention_bytes(node, graph: Graph) -> int:
    """Fused attention (flash, memory-efficient, the CPU's flash) keeps the fp32 log-sum-exp of each
    query row, [B, H, T], for its backward, and with a boolean mask the bias it made of it
    (`memory.mask_bias_bytes`): no graph value holds either."""
    shape = getattr(node.value, "shape", None)
    lse = 4 * shape[0] * shape[1] * shape[2] if shape is not None and len(shape) == 4 else 0
    return lse + mask_bias_bytes(node, graph)


def _document_attention_bytes(node, graph: Graph) -> int:
    """Document attention's fp32 lse, [B, H, S], a value of the graph that no other operator reads
    (its tuple is not counted as saved, since its output is the o-projection's), and its block mask:
    two int32 [B, S/128, S/128] block tables, each with its row counts, forward and transposed."""
    q = graph[node.args[0].value].spec
    B, H, S = q.shape[0], q.shape[1], q.shape[2]
    blocks = -(-S // FLEX_BLOCK)
    return 4 * B * H * S + 4 * 4 * B * blocks * (blocks + 1)


# target -> bytes its backward keeps that are no value of the graph (an operator's own buffers)
SAVED_INTERNAL: dict[str, Callable] = {
    "aten.scaled_dot_product_attention.default": _attention_bytes,
    DOCUMENT_ATTENTION: _document_attention_bytes,
}


def saved_internal(node, graph: Graph) -> int:
    """What `node`'s backward keeps beyond the graph's values (`SAVED_INTERNAL`; 0 by default)."""
    rule = SAVED_INTERNAL.get(node.target)
    return rule(node, graph) if rule is not None and node.op is OpKind.CALL else 0


def _tensor_args(node) -> list[str | None]:
    """The node's positional arguments as node names (None where not a tensor reference)."""
    return [a.value if isinstance(a, Sym) and a.kind == "ref" else None for a in node.args]


def saved(graph: Graph, costs: dict[str, NodeCost], rg: frozenset[str]) -> dict[str, set[str]]:
    def same_dtype_cast(name: str) -> bool:  # `x.to(x.dtype)` returns x itself
        node = graph[name]
        src = next(node.inputs(), None)
        return (node.target in ("aten.to.dtype", "aten._to_copy.default") and src is not None
                and isinstance(node.value, type(graph[src].value)) and node.value == graph[src].value)

    def base(name: str) -> str:
        """The value a view shows (a getitem of a non-view operator is a value of its own)."""
        while name in costs and (costs[name].alias or same_dtype_cast(name)):
            node = graph[name]
            src = next(node.inputs(), None)
            if src is None or (node.target == "getitem" and not (src in costs and costs[src].alias)):
                break
            name = src
        return name

    kept: dict[str, set[str]] = {}

    def keep(value: str, by: str) -> None:
        kept.setdefault(base(value), set()).add(by)

    for node in graph:
        if node.op is not OpKind.CALL or costs[node.name].alias:
            continue
        rule = SAVES.get(node.target)
        if rule is None:  # unknown: every tensor it reads, and its result
            for i in node.inputs():
                keep(i, node.name)
            keep(node.name, node.name)
            continue
        positions, result = rule
        args = _tensor_args(node)
        for i in positions(lambda k: k < len(args) and args[k] is not None and args[k] in rg):
            if i < len(args) and args[i] is not None:
                keep(args[i], node.name)
        if result:
            keep(node.name, node.name)
    return {n: by for n, by in kept.items() if graph[n].op in (OpKind.CALL, OpKind.GETITEM)}
