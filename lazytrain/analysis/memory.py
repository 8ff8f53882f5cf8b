"""Memory rules: bytes an operator holds inside itself, beyond the graph values it reads and makes.

Needs: a node and its `Graph`. Guarantees: `internal_bytes(node, graph)` is the most memory the
operator's own intermediates (not graph nodes) take while its forward runs; its backward holds
their gradients, of the same size. One rule per target with a default of 0, like `costs.RULES`.

    cross_entropy_loss(logits float32[N,V], target int64[N])  ->  4*N*V  (its log_softmax)

NOTE: [Operator workspace]
Liveness sees graph values only, but a composite operator can allocate more than its output inside
itself. `aten.cross_entropy_loss` is `nll_loss(log_softmax(input))`: forward allocates the
log-probabilities, as large as its input and in its dtype, and autograd keeps them; backward
allocates the gradient of those log-probabilities (nll_loss_backward, dense) and then the gradient
of the input (log_softmax_backward), while the log-probabilities are still held. Hugging Face's
`ForCausalLMLoss` upcasts the logits to fp32 first, so every one of these is fp32.
Qwen2.5-7B's vocabulary (152064) at 1 x 65536 tokens, bf16 compute:
    logits (lm_head output, bf16)        65536 * 152064 * 2 = 19.9 GB  (18.6 GiB)
    their fp32 upcast                    65536 * 152064 * 4 = 39.9 GB  (37.1 GiB)
    log_softmax inside the loss (fp32)                        39.9 GB  (37.1 GiB)
    backward: grad of the log-probs, then grad of the logits  39.9 GB each
The allocation that failed on the H200 asked for 37.1 GiB: one of these fp32 buffers. Counted:
  - a stage's `peak_bytes` (forward, liveness) adds the workspace at its node: upcast + log-probs
    = 79.7 GB there, where liveness alone saw the upcast and the bf16 logits (59.8 GB);
  - `internal_bytes` (the stage's largest) is added to a saving forward (beside what it saves)
    and to backward (the log-probs' gradient, beside the saved log-probs, which `saved` counts as
    the loss's input: same size and dtype, and the input's gradient, which the gradient model
    counts), so the unchunked 7B loss stage holds 3 x 39.9 GB in its backward, as torch does;
  - pass `chunk` sizes chunks by that working set, so one chunk's internals are in its peak.
"""

from __future__ import annotations

from typing import Callable

from lazytrain.ir.graph import Graph, Node, Sym, TensorSpec

Rule = Callable[[Node, Graph], int]
RULES: dict[str, Rule] = {}
# target -> bytes its backward holds of its own beyond the gradients it makes (default: its forward's
# `internal_bytes`, the gradients of those intermediates)
BACKWARD_RULES: dict[str, Rule] = {}


def _registrar(table: dict[str, Rule]):
    def rule(*targets: str):
        def register(fn: Rule) -> Rule:
            for t in targets:
                table[t] = fn
            return fn
        return register
    return rule


rule = _registrar(RULES)
rule_backward = _registrar(BACKWARD_RULES)


def _spec(graph: Graph, arg) -> TensorSpec | None:
    if isinstance(arg, Sym) and arg.kind == "ref" and isinstance(graph[arg.value].value, TensorSpec):
        return graph[arg.value].value
    return None


@rule("aten.cross_entropy_loss.default")
def _cross_entropy(node: Node, graph: Graph) -> int:
    """log_softmax of the input, in the input's dtype (NOTE: [Operator workspace])."""
    x = _spec(graph, node.args[0])
    return x.nbytes if x is not None else 0


def mask_bias_bytes(node: Node, graph: Graph) -> int:
    """Attention called with a boolean mask turns it into an additive bias of the query's dtype and
    the mask's shape, a new tensor in every call, which the memory-efficient kernel keeps for its
    backward. A causal mask the pass `causal` could not prove (it evaluates masks up to its
    EVAL_LIMIT) costs that much: at 65536 tokens [1, 1, 65536, 65536] in bf16, 8 GiB a layer."""
    args = dict(zip(("query", "key", "value", "attn_mask"), node.args)) | dict(node.kwargs)
    q, mask = _spec(graph, args.get("query")), _spec(graph, args.get("attn_mask"))
    if q is None or mask is None or mask.dtype != "bool":
        return 0
    return mask.numel * (q.nbytes // max(1, q.numel))


@rule("aten.scaled_dot_product_attention.default", "lazytrain.document_attention.default")
def _attention(node: Node, graph: Graph) -> int:
    """A boolean mask's bias (`mask_bias_bytes`); the forward's kernel keeps nothing else of its own
    that the plan counts (NOTE: [Attention's backward workspace])."""
    return mask_bias_bytes(node, graph)


def dq_accumulator_bytes(query_numel: int) -> int:
    """The fp32 accumulator of the queries' gradient that fused attention's backward keeps."""
    return 4 * query_numel


# NOTE: [Attention's backward workspace] Fused attention's backward keeps the queries' gradient in
# an fp32 accumulator (flash attention's `dq_accum`: 0.9 GiB for a 7B layer at 1 x 65536) and, with
# `enable_gqa`, makes the key's and value's gradients at the query's heads. Its forward keeps
# neither. The accumulator was once the forward's rule too, so every saving forward held it beside
# what it saved (`saving_workspace`): on the H200 (2026-12-05, 278ea05, `bench/fidelity.py run
# --fuse-stages`) the 7B at 1 x 131,072 in 24 GiB peaked at F28, the last layer's saving forward,
# 1.20 GiB under the plan's 21.46 GiB (the accumulator: 1.75 GiB), and the 1 x 262,144 plan's F28
# 2.96 GiB under (3.5); the row's peak +6 %, outside the 5 % check. Without it that plan prices F28
# at 20.69 GiB, and the mended plan ran at +2 % (20.9 GiB against 21.3, a540c90). The forward
# windows of recomputed layers read 0.26 GiB over their plans there (0.54 at 262,144): what they hold
# beyond the count is not known yet, and not counted.
@rule_backward("aten.scaled_dot_product_attention.default", "lazytrain.document_attention.default")
def _attention_backward(node: Node, graph: Graph) -> int:
    """A boolean mask's bias, the queries' fp32 gradient accumulator, and with `enable_gqa` the
    key's and value's gradients at the query's heads, which the kernel makes before it sums them
    down to the key-value heads: 1.75 GiB of a 7B layer's 5.53 at 131,072 tokens (NOTE: [Grouped-query
    attention unrepeated] in passes/gqa.py; NOTE: [Attention's backward workspace])."""
    q = _spec(graph, node.args[0]) if node.args else None
    extra = dq_accumulator_bytes(q.numel) if q is not None else 0
    if dict(node.kwargs).get("enable_gqa", False):
        k, v = (_spec(graph, a) for a in node.args[1:3])
        if q is not None and k is not None and v is not None:
            extra += gqa_gradients_bytes(q.shape[1], k.shape[1], k.nbytes + v.nbytes)
    return mask_bias_bytes(node, graph) + extra


def gqa_gradients_bytes(query_heads: int, kv_heads: int, kv_bytes: int) -> int:
    """The key's and value's gradients at the query's heads, which attention's backward makes inside
    the kernel before it sums them down to `kv_heads` heads (`kv_bytes`: the key's and value's bytes)."""
    return kv_bytes * (query_heads // kv_heads) if kv_heads else 0


def tile_rows(x: TensorSpec, tiles: int) -> int:
    """Rows (tokens) in the largest of `tiles` tiles of x's rows, as the tiled operators split them
    (kernels/tiling.py: at most one tile a row)."""
    rows = x.numel // max(1, x.shape[-1])
    return -(-rows // max(1, min(int(tiles), rows)))


def _mlp_tile(node: Node, graph: Graph) -> tuple[int, int, int, int]:
    """(tile tokens, intermediate size, hidden size, itemsize) of a tiled gated MLP."""
    x, gate = _spec(graph, node.args[0]), _spec(graph, node.args[1])
    return tile_rows(x, node.args[5]), gate.shape[0], gate.shape[1], x.nbytes // max(1, x.numel)


@rule("lazytrain.gated_mlp.default")
def _gated_mlp(node: Node, graph: Graph) -> int:
    """One tile's gate and up products, its activation and their product (NOTE: [Tiled MLP])."""
    tile, inter, _, item = _mlp_tile(node, graph)
    return 4 * tile * inter * item


@rule_backward("lazytrain.gated_mlp.default")
def _gated_mlp_backward(node: Node, graph: Graph) -> int:
    """One tile recomputed (4 intermediates) and its gradients (4 more), and, for 16-bit weights, the
    fp32 sums of the three weights' gradients over the tiles and one tile's product beside them."""
    tile, inter, hidden, item = _mlp_tile(node, graph)
    return 8 * tile * inter * item + (4 * 4 * inter * hidden if item < 4 else 0)


def _norm_tile(node: Node, graph: Graph) -> int:
    """Elements of one tile of a tiled RMSNorm's rows (NOTE: [Tiled RMSNorm])."""
    x = _spec(graph, node.args[0])
    return tile_rows(x, node.args[4]) * x.shape[-1]


@rule("lazytrain.rms_norm.default")
def _rms_norm(node: Node, graph: Graph) -> int:
    """One tile's float32 rows, their square and the normed rows, and the cast back (4 bytes each,
    counted as 4 float32 tiles: NOTE: [Tiled RMSNorm])."""
    return 4 * 4 * _norm_tile(node, graph)


@rule_backward("lazytrain.rms_norm.default")
def _rms_norm_backward(node: Node, graph: Graph) -> int:
    """One tile recomputed (the float32 rows and the normed rows), the gradient's product with the
    weight and its float32 cast, the weight's product, and the chain rule's two terms: 8 float32
    tiles, and the float32 sum of the weight's gradient."""
    w = _spec(graph, node.args[1])
    return 4 * 8 * _norm_tile(node, graph) + 4 * (w.numel if w is not None else 0)


# NOTE: [Backward temporaries]
# Some derivative formulas make a tensor as large as the node's output before the gradient they
# return, and the gradients alone do not show it. On the H200 the 7B at 1 x 131072 (tiled MLPs,
# a 24 GiB plan) ran out of memory in its first layer backward: bench/stage_memory.py measured 7.41
# GiB held above what its forward left, the plan 3.83 (2026-12-03); the peak grew at a `mul`. The
# formulas (derivatives.yaml), measured on the CPU by the tensors made during one op's backward,
# in units of its output (fp32, 4096 x 1024):
#   mul, an input broadcast (RMSNorm's x * rsqrt(var), weight * x): its gradient is
#     sum_to_size(grad * other): the product, output-sized, beside the other input's gradient (2.0
#     where the gradients alone are 1.0);
#   pow(x, 2) (RMSNorm's variance): grad * (2 * x.pow(1)): two output-sized temporaries beside the
#     gradient (3.0 where the gradient alone is 1.0).
#   a gradient reaching a value through an `expand` that grows it (a key or value head repeated for
#     grouped queries, where the repeat is a view: one key-value head) arrives at the expanded size
#     and is summed down after: attention's backward made three query-sized gradients beside each
#     other where the plan counted one and two key-sized (tests/test_backward_memory.py, 0.79 MB
#     over of 6.8 once tiled norms no longer held the peak; analysis/backward.py, `widened`).
# A Qwen2 RMSNorm's backward in bf16 holds 5 fp32 [S, H] at its peak.


@rule_backward("aten.mul.Tensor")
def _mul_backward(node: Node, graph: Graph) -> int:
    """The output-sized product a broadcast input's gradient is summed from (NOTE: [Backward temporaries])."""
    out = node.value if isinstance(node.value, TensorSpec) else None
    if out is None:
        return 0
    ins = [_spec(graph, a) for a in node.args[:2]]
    broadcast = any(t is not None and t.numel < out.numel for t in ins)
    return out.nbytes if broadcast else 0


@rule_backward("aten.pow.Tensor_Scalar")
def _pow_backward(node: Node, graph: Graph) -> int:
    """x.pow(e - 1) and its product with e, each output-sized (NOTE: [Backward temporaries])."""
    out = node.value if isinstance(node.value, TensorSpec) else None
    exponent = node.args[1] if len(node.args) > 1 else None
    if out is None or exponent in (0, 1, 0.0, 1.0):
        return 0
    return 2 * out.nbytes


def _none(node: Node, graph: Graph) -> int:
    return 0


def internal_bytes(node: Node, graph: Graph) -> int:
    return RULES.get(node.target, _none)(node, graph)



@rule_backward("aten.embedding.default")
def _embedding_backward(node: Node, graph: Graph) -> int:
    """The dense backward of an embedding (CUDA's embedding_dense_backward) sorts the indices and
    sums each row's gradients in fp32 before writing the weight's: 6.5 bytes per element of its
    output measured on the H200 (bf16, Qwen2.5-7B's embedding at 32 x 1024 and 1 x 65536 tokens:
    0.71 and 1.44 GiB), counted as 7."""
    out = node.value if isinstance(node.value, TensorSpec) else None
    return 7 * out.numel if out is not None else 0


def backward_internal_bytes(node: Node, graph: Graph) -> int:
    rule_ = BACKWARD_RULES.get(node.target)
    return rule_(node, graph) if rule_ is not None else internal_bytes(node, graph)
