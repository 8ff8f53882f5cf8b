"""Pass `costs`: FLOPs, bytes moved and predicted seconds for every operator node.

Needs: a `Graph` and a `Hardware` profile. Guarantees: one `NodeCost` per CALL/GETITEM node, from
the per-op rule registered for its target, or the default (elementwise) rule.

    linear_3 = aten.linear.default(x[8,64], w[32,64])  ->  flops = 2*8*32*64, bytes = in + out

Time is a roofline: max(flops / achieved peak, bytes / memory bandwidth) + a per-op overhead.
Backward is charged `bwd_factor` times the forward (2 for matmuls: grads of input and weight).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from lazytrain.analysis.memory import tile_rows
from lazytrain.hardware import Hardware
from lazytrain.ir.graph import Graph, Node, OpKind, TensorSpec, value_bytes


@dataclass(frozen=True, slots=True)
class NodeCost:
    flops: float
    bytes: float  # bytes read + written
    time_s: float  # forward
    bwd_time_s: float
    alias: bool  # the output is a view of an input: it owns no memory
    elementwise: bool = False  # neither a matmul, attention nor a view: work Inductor fuses (NOTE: [Fused stage prices])


@dataclass(frozen=True, slots=True)
class _Rule:
    flops: Callable[[Node, Graph], float]
    bwd_factor: float = 1.0
    alias: bool = False
    passes: float = 1.0  # times the kernels read and write the inputs and output (NOTE: [Measured operator rates])


RULES: dict[str, _Rule] = {}


def rule(*targets: str, bwd_factor: float = 1.0, alias: bool = False, passes: float = 1.0):
    def register(fn):
        for t in targets:
            RULES[t] = _Rule(fn, bwd_factor, alias, passes)
        return fn
    return register


# NOTE: [Measured operator rates]
# The rules' constants come from `bench/opcost.py`, which profiles one decoder layer and the chunked
# loss stage of the 1.5B, 7B and 14B bench shapes on the H200 (bench/results/opcost, 2026-11-30):
#   - matmuls of those layers and of lm_head ran at 770-810 TFLOP/s (bf16), the profile's `flops`;
#     a fraction of 0.75 of a 759 TFLOP/s peak had hidden the elementwise time below;
#   - elementwise kernels moved 2.8 TB/s (dtype conversions, the softmax kernels), the
#     profile's `mem_bandwidth`; the backward of a product writes a gradient per operand
#     (`bwd_factor` 2), which a factor of 1 halved: every layer's non-matmul time was 2.0-2.4x its
#     prediction, the loss stage's 2.5-2.8x;
#   - cross-entropy over V classes: its log_softmax reads the logits twice and writes them once
#     (`passes` 3), and its backward fills a zero gradient and runs the softmax backward (read
#     two, write one): 4 passes, measured 9.8 and 12.9 ms for the 1.5B's 2.49 G logits;
#   - fused causal attention (cuDNN) reached `attention_fraction` of the matmul rate;
#   - inside a running step, beside the copy engines and the GPU optimizer steps on their own
#     stream, the compute events of Qwen2.5-7B plans took 1.11-1.12x what these rates predict
#     (fidelity traces, 2026-11-30; the same operators' kernel times were within 5% of the isolated
#     ones, the rest is the device shared and idle moments inside events): `achieved_fraction`
#     0.9 scales both rates.


def _in(node: Node, graph: Graph, i: int) -> TensorSpec:
    return graph[node.args[i].value].spec


MATMULS = ("aten.linear.default", "aten.mm.default", "aten.bmm.default", "aten.matmul.default", "aten.addmm.default",
           "aten._grouped_mm.default", "transformers.grouped_mm_fallback.default")


def _fuses(node: Node, alias: bool) -> bool:
    """Element-wise work Inductor fuses (NOTE: [Fused stage prices] in passes/fusion.py): neither a
    view, a matmul, attention, nor one of lazytrain's own operators, which it calls as they are
    (kernels/: the tiled MLP and norm, document attention)."""
    return not alias and node.target not in MATMULS and node.target not in ATTENTION \
        and not str(node.target).startswith("lazytrain.")


@rule("aten.linear.default", bwd_factor=2.0)
def _linear(node, graph):
    w = _in(node, graph, 1)
    return 2.0 * node.spec.numel * w.shape[-1]


@rule("aten.mm.default", "aten.bmm.default", "aten.matmul.default", bwd_factor=2.0)
def _matmul(node, graph):
    return 2.0 * node.spec.numel * _in(node, graph, 0).shape[-1]


@rule("aten.addmm.default", bwd_factor=2.0)
def _addmm(node, graph):
    return 2.0 * node.spec.numel * _in(node, graph, 1).shape[-1]


# NOTE: [Routed experts]
# A mixture-of-experts layer routes each token to top_k of E experts; how many rows each expert gets
# is known only at run time. The graph does not depend on it: transformers' grouped_mm experts sort
# the tokens × top_k (token, expert) pairs by expert and run one grouped matmul over all of them
# (rows = tokens × top_k, split among experts by `offs`, a tensor), against every expert's weights
# in one parameter [E, out, in]. So the work is static: 2 · tokens · top_k · in · out FLOPs for any
# routing, outputs and saved activations of tokens × top_k rows, and all E experts' weights belong
# to the layer's block, resident or streamed as one. The kernel's own working set is its output.
# Expert code with data-dependent shapes (the "eager" loop over `nonzero()`) does not capture: it
# is refused with a TraceError naming the line.
@rule("aten._grouped_mm.default", "transformers.grouped_mm_fallback.default", bwd_factor=2.0)
def _grouped_mm(node, graph):
    return 2.0 * node.spec.numel * _in(node, graph, 0).shape[-1]


GATED_MLP = "lazytrain.gated_mlp.default"  # NOTE: [Tiled MLP] in kernels/tiled_mlp.py


# A tiled gated MLP (NOTE: [Tiled MLP] in kernels/tiled_mlp.py): three [tokens, H] x [H, I]
# products forward; backward recomputes two of them and runs six: (2 + 6) / 3 of the forward.
@rule(GATED_MLP, bwd_factor=8 / 3)
def _gated_mlp(node, graph):
    x, gate = _in(node, graph, 0), _in(node, graph, 1)
    return 6.0 * (x.numel // x.shape[-1]) * gate.shape[0] * gate.shape[1]


RMS_NORM = "lazytrain.rms_norm.default"  # NOTE: [Tiled RMSNorm] in kernels/tiled_norm.py


# A tiled RMSNorm runs the eager norm's kernels a tile at a time: priced as they are. Their passes
# over its input and output (x + y, 4 bytes an element in bf16): the float32 cast 6, the square 8,
# the mean 4, x * rsqrt 8, the cast back 6, the weight's product 4: 36 bytes, 9 passes; backward
# recomputes those and runs the eager backward's 48: (36 + 48) / 36 of the forward.
rule(RMS_NORM, bwd_factor=7 / 3, passes=9.0)(lambda node, graph: 0.0)


DOCUMENT_ATTENTION = "lazytrain.document_attention.default"  # NOTE: [Document attention] in kernels/documents.py
ATTENTION = ("aten.scaled_dot_product_attention.default", "aten._scaled_dot_product_flash_attention.default",
             "aten._scaled_dot_product_efficient_attention.default", DOCUMENT_ATTENTION)


# NOTE: [Attention at length] Fused attention's share of the matmul rate grows with the keys each
# query reads: its tiles fill and the softmax's fixed costs spread. On the H200, `bench/opcost.py`
# measured 0.41 at 1024 keys (Qwen2.5 1.5B-14B layers, 2026-11-30), and the 7B at 1 x 65536 ran its
# layers' forward in 108 ms and backward with recompute in 360 ms (the fidelity trace, 2026-12-01)
# where one share of 0.41 predicted 164 and 530. The profile's rate is fraction * T / (T + tokens):
# 0.77 and 900 tokens fit both (0.41 at 1024, 0.76 at 65536). Two lengths only: lengths between them
# are interpolated, not measured.
def _keys(node, graph) -> int:
    k = _in(node, graph, 1)
    return k.shape[-2] if len(k.shape) >= 2 else 1


@rule(*ATTENTION, bwd_factor=2.5)
def _sdpa(node, graph):
    q, k = _in(node, graph, 0), _in(node, graph, 1)
    *batch, lq, d = q.shape
    nb = 1
    for b in batch:
        nb *= b
    # document attention is priced as causal over the whole row: the bound, whatever the packing
    causal = node.target == DOCUMENT_ATTENTION or dict(node.kwargs).get(
        "is_causal", node.args[5] if len(node.args) > 5 else False)
    return 4.0 * nb * lq * k.shape[-2] * d * (0.5 if causal else 1.0)  # QK^T and PV (causal: half of it)


_VIEWS = (
    "view.default", "_unsafe_view.default", "reshape.default", "transpose.int", "permute.default", "unsqueeze.default",
    "squeeze.dim", "squeeze.dims", "squeeze.default", "expand.default", "slice.Tensor", "select.int", "t.default",
    "alias.default", "detach.default", "split.Tensor", "split_with_sizes.default", "chunk.default", "unbind.int",
    "as_strided.default", "view_as.default", "flatten.using_ints", "unflatten.int",
)


@rule(*(f"aten.{v}" for v in _VIEWS), "getitem", bwd_factor=0.0, alias=True)
def _view(node, graph):
    return 0.0


def _elementwise(node, graph):
    return float(sum(v.numel for v in _specs(node)))


# NOTE: [Measured operator rates]: a gradient per operand
rule("aten.mul.Tensor", "aten.div.Tensor", bwd_factor=2.0)(_elementwise)
# NOTE: [Measured operator rates]: log_softmax's passes over the logits, then the backward's
rule("aten.cross_entropy_loss.default", bwd_factor=4 / 3, passes=3.0)(_elementwise)


def _specs(node: Node):
    if isinstance(node.value, TensorSpec):
        return [node.value]
    return [v for v in (node.value or ()) if v is not None]


_DEFAULT = _Rule(_elementwise, 1.0, False)


def requires_grad(graph: Graph) -> frozenset[str]:
    """The values backward computes a gradient for: parameters and the floating values made from them."""
    rg = set()
    for node in graph:
        if node.op is OpKind.PARAM:
            rg.add(node.name)
        elif node.op in (OpKind.CALL, OpKind.GETITEM):
            floats = isinstance(node.value, TensorSpec) and node.value.is_float or (
                isinstance(node.value, tuple) and any(v is not None and v.is_float for v in node.value))
            if floats and any(i in rg for i in node.inputs()) and node.target != "aten.detach.default":
                rg.add(node.name)
    return frozenset(rg)


# NOTE: [Gradient sums] A value read by k operators that backward differentiates gets k gradients,
# which autograd adds up as they arrive: k - 1 additions that read two and write one tensor of its
# size (a decoder layer's normed input feeds q, k and v; the residual stream feeds a norm and an
# add). Charged to the value's own node. Measured on the H200 (`bench/opcost.py`, 2026-11-30): the
# add_ kernels of a Qwen2.5-7B layer's backward took 2.2 ms of its 85.6, which no rule counted.
def _gradient_sums_s(node: Node, users: list[str], rg: frozenset[str], hw: Hardware) -> float:
    k = sum(1 for u in users if u in rg)
    return (k - 1) * 3 * value_bytes(node.value) / hw.bytes_per_s if k > 1 and node.name in rg else 0.0


# NOTE: [Layouts that decide a copy] Whether a reshape or a `contiguous` copies depends on the
# strides of what it reads, which the graph does not carry. Two cases in every decoder layer:
#   - grouped-query attention repeats k and v as `expand` then `reshape` ([B, KV, n, T, D] to
#     [B, KV*n, T, D]); the expanded dimension has stride 0, so the reshape copies, and attention's
#     backward keeps the copies (not the KV-sized values they came from). Pass `gqa` removes the
#     repeats where attention has no mask (NOTE: [Grouped-query attention unrepeated]);
#   - fused attention (flash, memory-efficient, the CPU's flash) lays its output out as [B, T, H, D]
#     and returns it transposed, so the `contiguous` after the layer's `transpose(1, 2)` copies
#     nothing, and the o-projection's saved input is attention's own output.
# Counted the other way, a Qwen2.5-1.5B layer at 16 x 1024 tokens saved 32 MiB more than planned
# (80 MiB of repeated k and v missing, 48 MiB of a copy too many), measured on the CPU with saved-
# tensor hooks and on the H200 by the allocator, event by event: 0.9 GiB over 28 layers, which
# ran the 7B's max-budget plan out of memory once its bf16 twins shrank (NOTE: [Twin chunks]).
def _through_views(name: str, graph: Graph, table: dict) -> list[Node]:
    """The chain of view nodes `name` reads through, nearest first, and the value they view last."""
    chain = []
    while True:
        node = graph[name]
        chain.append(node)
        cost = table.get(name)
        if cost is None or not cost.alias:
            return chain
        src = next(node.inputs(), None)
        if src is None:
            return chain
        name = src


def _copying_reshape(node: Node, graph: Graph, table: dict) -> bool:
    """A reshape that merges a dimension `expand` broadcast (NOTE: [Layouts that decide a copy])."""
    if node.target != "aten.reshape.default":
        return False
    src = next(node.inputs(), None)
    for v in _through_views(src, graph, table) if src is not None else ():
        if v.target == "aten.expand.default":
            inner = graph[next(v.inputs())].spec
            return v.spec.numel > inner.numel and [d for d in node.spec.shape if d != 1] != [d for d in v.spec.shape if d != 1]
    return False


def _free_contiguous(node: Node, graph: Graph, table: dict) -> bool:
    """`contiguous` of fused attention's output transposed back to [B, T, H, D] (NOTE: [Layouts that
    decide a copy]): through views, reshapes and one transpose of dimensions 1 and 2."""
    src = next(node.inputs(), None)
    if node.target != "aten.contiguous.default" or src is None:
        return False
    *views, base = _through_views(src, graph, table)
    transposes = [v for v in views if v.target == "aten.transpose.int"]
    return (base.target in ATTENTION and len(transposes) == 1 and _swaps_heads_and_tokens(transposes[0])
            and all(v.target in ("aten.transpose.int", "aten.reshape.default", "aten.view.default") for v in views))


def _swaps_heads_and_tokens(t: Node) -> bool:
    dims = {a for a in t.args[1:3] if isinstance(a, int)} if len(t.args) >= 3 else set()
    return dims in ({1, 2}, {-3, -2})


def costs(graph: Graph, hw: Hardware) -> dict[str, NodeCost]:
    table: dict[str, NodeCost] = {}
    rg, users = requires_grad(graph), graph.users()
    for node in graph:
        if node.op not in (OpKind.CALL, OpKind.GETITEM):
            continue
        r = RULES.get(node.target, _DEFAULT)
        alias = (r.alias and not _copying_reshape(node, graph, table)) or _free_contiguous(node, graph, table)
        flops = r.flops(node, graph)
        nbytes = 0.0 if alias else float(value_bytes(node.value) + sum(value_bytes(graph[i].value) for i in set(node.inputs())))
        dtype = next((s.dtype for s in _specs(node)), "float32")
        rate = hw.flops_for(dtype) * (hw.attention_share(_keys(node, graph)) if node.target in ATTENTION else 1.0)
        if node.target == GATED_MLP:  # NOTE: [Matmuls of a tile] in hardware/__init__.py
            rate *= hw.tile_share(tile_rows(_in(node, graph, 0), node.args[5]))
        t = 0.0 if alias else max(flops / rate, r.passes * nbytes / hw.bytes_per_s) + hw.op_overhead_s
        bwd = t * (r.bwd_factor if r.alias == alias else 1.0)
        table[node.name] = NodeCost(flops, nbytes, t, bwd + _gradient_sums_s(node, users[node.name], rg, hw), alias,
                                    _fuses(node, alias))
    return table
