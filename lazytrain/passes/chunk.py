"""Pass `chunk`: run the last stage (final norm, lm_head, loss) in k chunks along the batch.

Needs: the `Graph` and its `Stages` (from `blocks`). Guarantees: the same stages, except that when
the last stage is provably row-wise and its working set is over `limit` bytes, the last stage
carries `chunks=k` (k divides the batch) and memory figures for one chunk: `peak_bytes` is one
chunk's working set and `saved_bytes` is 0, since its forward and backward run together, chunk by
chunk, in its backward window (NOTE: [Chunked loss] in runtime/trainer.py). Otherwise the stages
come back unchanged (k = 1).

    epilogue  saved=31.8 GB peak=29.9 GB   (batch 32; logits 32768 x 152064)
      -> epilogue chunks=32 saved=0 peak=2.0 GB

Row-wise means every tensor that depends on the batch (a batch input or a stage input) keeps the
batch rows along its leading dimension, so the loss terms of one row depend on that row alone:
  - the loss is `cross_entropy_loss` with reduction mean, no class weights and no label smoothing:
    then mean = (sum of the per-target losses) / (number of targets not equal to ignore_index), and
    both sums split over chunks exactly;
  - every other node's op is in `RULES` (an allowlist: elementwise ops, casts, norms and reductions
    over non-batch dims, linear/mm/matmul with a weight, views that keep the rows leading, pad and
    slice of non-batch dims), and its rule accepts how the node uses the batch;
  - every batch-dependent tensor has a leading dimension that is a multiple of the batch B; stage
    inputs and batch inputs have exactly B. A view keeps the rows together when its output's
    leading dimension is a multiple of B ([B, T, V] -> [B*T, V]), since views keep row-major order;
    its new shape must lead with -1, so that it fits a chunk's fewer rows.
The op rules err on the side of refusing: an op not listed, or used in a way a rule cannot prove
row-wise, leaves the stage unchunked (the reason is in the `--dump-ir` file of this pass).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Callable

from lazytrain.ir.graph import Graph, Node, OpKind, Sym, TensorSpec, value_bytes
from lazytrain.passes.blocks import Stage, Stages
from lazytrain.passes.costs import RULES as COST_RULES

LOSS_CHUNK_BYTES = 1 << 30  # default largest working set of one chunk of the last stage
MEAN, SUM = 1, 2  # torch's Reduction enum, as cross_entropy_loss takes it
LOSS_OP = "aten.cross_entropy_loss.default"
_LOSS_SCHEMA = (("input", None), ("target", None), ("weight", None), ("reduction", MEAN), ("ignore_index", -100),
                ("label_smoothing", 0.0))


@dataclass(frozen=True, slots=True)
class LossArgs:
    input: Sym
    target: Sym
    weight: object
    reduction: int
    ignore_index: int
    label_smoothing: float


def loss_args(node: Node) -> LossArgs:
    """A cross_entropy_loss node's arguments with torch's defaults filled in (codegen reads them too)."""
    given = dict(zip((name for name, _ in _LOSS_SCHEMA), node.args)) | dict(node.kwargs)
    return LossArgs(**{name: given.get(name, default) for name, default in _LOSS_SCHEMA})


@dataclass(frozen=True, slots=True)
class Decision:
    chunks: int
    reason: str  # why the stage is (not) chunked, for the dump and tests
    chunk_bytes: int  # working set of one chunk: max(peak, 2 * saved) / chunks, plus what does not shrink


# ---- per-op rules ---------------------------------------------------------------------------------

class _Ctx:
    def __init__(self, graph: Graph, batch: int, batched: set[str]):
        self.graph, self.batch, self.batched = graph, batch, batched

    def spec(self, arg) -> TensorSpec | None:
        if isinstance(arg, Sym) and arg.kind == "ref" and isinstance(self.graph[arg.value].value, TensorSpec):
            return self.graph[arg.value].value
        return None

    def is_batched(self, arg) -> bool:
        return isinstance(arg, Sym) and arg.kind == "ref" and arg.value in self.batched


Rule = Callable[[Node, _Ctx], str | None]  # None: row-wise; else why not
RULES: dict[str, Rule] = {}


def rule(*targets: str):
    def register(fn: Rule) -> Rule:
        for t in targets:
            RULES[f"aten.{t}"] = fn
        return fn
    return register


def _dim(d: int, ndim: int) -> int:
    return d + ndim if d < 0 else d


def _arg(node: Node, i: int, name: str, default=None):
    return node.args[i] if len(node.args) > i else dict(node.kwargs).get(name, default)


@rule(  # shape-preserving or broadcasting elementwise ops
    "add.Tensor", "sub.Tensor", "mul.Tensor", "div.Tensor", "add.Scalar", "sub.Scalar", "mul.Scalar", "div.Scalar",
    "pow.Tensor_Scalar", "pow.Tensor_Tensor", "neg.default", "rsqrt.default", "sqrt.default", "exp.default",
    "log.default", "tanh.default", "sigmoid.default", "relu.default", "gelu.default", "silu.default", "abs.default",
    "reciprocal.default", "where.self", "clamp.default", "to.dtype", "to.dtype_layout", "to.device", "_to_copy.default",
    "clone.default", "contiguous.default", "alias.default", "detach.default", "type_as.default")
def _elementwise(node: Node, ctx: _Ctx) -> str | None:
    """Batch operands line up with the output row for row; other operands broadcast over the rows."""
    out = node.value
    for a in (*node.args, *(v for _, v in node.kwargs)):
        spec = ctx.spec(a)
        if spec is None:
            continue
        if ctx.is_batched(a):
            if len(spec.shape) != len(out.shape) or spec.shape[0] != out.shape[0]:
                return f"{a.value} {spec} and the output {out} do not line up row for row"
        elif len(spec.shape) == len(out.shape) and spec.shape[0] != 1:
            return f"{a.value} {spec} does not depend on the batch but spans the output's leading dimension"
    return None


def _not_dim0(dims, ndim: int, what: str) -> str | None:
    if dims is None or (isinstance(dims, tuple) and not dims):
        return f"{what} over every dimension"
    dims = dims if isinstance(dims, tuple) else (dims,)
    return f"{what} over the batch dimension" if 0 in {_dim(d, ndim) for d in dims} else None


@rule("mean.dim", "sum.dim_IntList", "amax.default", "logsumexp.default")
def _reduce(node: Node, ctx: _Ctx) -> str | None:
    return _not_dim0(_arg(node, 1, "dim"), len(ctx.spec(node.args[0]).shape), "reduces")


@rule("softmax.int", "_softmax.default", "log_softmax.int", "_log_softmax.default")
def _softmax(node: Node, ctx: _Ctx) -> str | None:
    return _not_dim0(_arg(node, 1, "dim"), len(ctx.spec(node.args[0]).shape), "normalises")


@rule("layer_norm.default", "rms_norm.default")
def _norm(node: Node, ctx: _Ctx) -> str | None:
    if not ctx.is_batched(node.args[0]):
        return "the batch operand is not the normalised one"
    if len(_arg(node, 1, "normalized_shape")) >= len(ctx.spec(node.args[0]).shape):
        return "normalises over the batch dimension"
    return _weights_only(node, ctx, skip=1)


def _weights_only(node: Node, ctx: _Ctx, skip: int) -> str | None:
    """Operands after the first `skip` must not depend on the batch (weights, biases)."""
    rest = (*node.args[skip:], *(v for _, v in node.kwargs))
    batched = [a.value for a in rest if ctx.is_batched(a)]
    return f"mixes rows through {batched[0]}" if batched else None


@rule("linear.default", "mm.default", "matmul.default")
def _matmul(node: Node, ctx: _Ctx) -> str | None:
    x = ctx.spec(node.args[0])
    if not ctx.is_batched(node.args[0]) or x is None or len(x.shape) < 2:
        return "the batch operand is not the first, or has no row dimension"
    w = ctx.spec(node.args[1])
    if node.target == "aten.matmul.default" and (w is None or len(w.shape) > 2):
        return "a batched matmul broadcasts over the leading dimension"
    return _weights_only(node, ctx, skip=1)


@rule("view.default", "reshape.default", "_unsafe_view.default")
def _view(node: Node, ctx: _Ctx) -> str | None:
    shape = node.args[1]
    if not shape or shape[0] != -1:  # a chunk has fewer rows: only -1 adapts to it
        return f"the new shape {list(shape)} fixes the leading dimension"
    return None


@rule("flatten.using_ints")
def _flatten(node: Node, ctx: _Ctx) -> str | None:
    return None  # merges dimensions without naming sizes; the leading-dimension check does the rest


@rule("unsqueeze.default", "squeeze.dim", "select.int")
def _one_dim(node: Node, ctx: _Ctx) -> str | None:
    ndim = len((node.value if node.target == "aten.unsqueeze.default" else ctx.spec(node.args[0])).shape)
    return "works on the batch dimension" if _dim(node.args[1], ndim) == 0 else None


@rule("transpose.int")
def _transpose(node: Node, ctx: _Ctx) -> str | None:
    ndim = len(ctx.spec(node.args[0]).shape)
    return "moves the batch dimension" if 0 in (_dim(node.args[1], ndim), _dim(node.args[2], ndim)) else None


@rule("permute.default")
def _permute(node: Node, ctx: _Ctx) -> str | None:
    ndim = len(ctx.spec(node.args[0]).shape)
    return "moves the batch dimension" if _dim(node.args[1][0], ndim) != 0 else None


@rule("slice.Tensor")
def _slice(node: Node, ctx: _Ctx) -> str | None:
    x = ctx.spec(node.args[0])
    dim, start, end, step = (_arg(node, i, name, default) for i, name, default in
                             ((1, "dim", 0), (2, "start", None), (3, "end", None), (4, "step", 1)))
    whole = start in (None, 0) and (end is None or end >= x.shape[0]) and step == 1
    return None if _dim(dim, len(x.shape)) != 0 or whole else "slices the batch dimension"


@rule("pad.default", "constant_pad_nd.default")
def _pad(node: Node, ctx: _Ctx) -> str | None:
    return "pads the batch dimension" if len(node.args[1]) // 2 >= len(ctx.spec(node.args[0]).shape) else None


def _loss(node: Node, ctx: _Ctx) -> str | None:
    a = loss_args(node)
    if a.weight is not None or a.reduction != MEAN or a.label_smoothing != 0.0:
        return (f"the loss has weight={a.weight}, reduction={a.reduction}, label_smoothing={a.label_smoothing} "
                "(only an unweighted mean without label smoothing splits into per-chunk sums)")
    x, t = ctx.spec(a.input), ctx.spec(a.target)
    if not (ctx.is_batched(a.input) and ctx.is_batched(a.target)) or x is None or t is None:
        return "the loss's input or target does not depend on the batch"
    if t.is_float or len(x.shape) < 2 or x.shape[0] != t.shape[0]:
        return f"the loss's input {x} and target {t} are not class indices, row for row"
    return None


# ---- the analysis ---------------------------------------------------------------------------------

def _batch_size(graph: Graph) -> int | None:
    """The leading dimension every batch input shares, or None."""
    sizes = {n.spec.shape[0] if n.spec.shape else None for n in graph.of(OpKind.INPUT)}
    return sizes.pop() if len(sizes) == 1 else None


def rowwise(graph: Graph, stage: Stage, batch: int) -> tuple[str | None, set[str]]:
    """(None, batch-dependent nodes) when `stage` is row-wise over batch rows, else (why not, {})."""
    if stage.outputs != (graph.output,) or graph[graph.output].target != LOSS_OP:
        return f"the stage's output is not only a {LOSS_OP} loss", set()
    batched = set(stage.inputs) | {p for p in stage.placeholders if graph[p].op is OpKind.INPUT}
    for name in sorted(batched):
        spec = graph[name].value
        if not isinstance(spec, TensorSpec) or not spec.shape or spec.shape[0] != batch:
            return f"{name} ({spec}) does not have the batch ({batch}) as its leading dimension", set()
    ctx = _Ctx(graph, batch, batched)
    for name in stage.nodes:
        node = graph[name]
        if any(i in batched for i in node.inputs()):
            batched.add(name)
        if name == graph.output:
            why = _loss(node, ctx)
        elif node.op is OpKind.GETITEM:
            why = None  # an element of a node already checked
        elif node.target not in RULES:
            why = f"{node.target} is not known to be row-wise"
        else:
            why = RULES[node.target](node, ctx) if name in batched else None
        if why:
            return f"{name}: {why}", set()
        specs = node.value if isinstance(node.value, tuple) else (node.value,)
        for spec in specs if name in batched and name != graph.output else ():
            if spec is not None and (not spec.shape or spec.shape[0] % batch):
                return f"{name}: {spec} does not keep the batch rows leading", set()
    return None, batched


def choose_chunks(batch: int, working: int, limit: int) -> int:
    """The fewest chunks, a divisor of `batch`, that bring `working` bytes to at most `limit` (or
    `batch` chunks when none does); 1 when `working` fits already or chunking is off (limit 0)."""
    if limit <= 0 or batch <= 1 or working <= limit:
        return 1
    return next((k for k in range(2, batch + 1) if batch % k == 0 and math.ceil(working / k) <= limit), batch)


def decide(graph: Graph, stages: Stages, limit: int = LOSS_CHUNK_BYTES) -> Decision:
    """How many chunks the last stage runs in, why, and one chunk's working set."""
    last = stages[len(stages) - 1]
    working = max(last.peak_bytes, 2 * last.saved_bytes)
    batch = _batch_size(graph)
    if limit <= 0:
        return Decision(1, "off", working)
    if batch is None or batch <= 1:
        return Decision(1, f"the batch inputs do not share a leading dimension above 1 ({batch})", working)
    if working <= limit:
        return Decision(1, f"its working set ({working} bytes) is within the limit ({limit})", working)
    why, batched = rowwise(graph, last, batch)
    if why:
        return Decision(1, why, working)
    k = choose_chunks(batch, working, limit)
    # Nodes that do not depend on the batch are as large in every chunk (counted twice, like saved
    # tensors and their gradients).
    whole = sum(value_bytes(graph[n].value) for n in last.nodes
                if n not in batched and not getattr(COST_RULES.get(graph[n].target), "alias", False))
    return Decision(k, f"{k} chunks of {batch // k} rows", math.ceil(working / k) + 2 * whole)


def chunk(stages: Stages, d: Decision) -> Stages:
    """The stages with `decide`'s decision applied to the last one."""
    if d.chunks == 1:
        return stages
    last = dataclasses.replace(stages[len(stages) - 1], chunks=d.chunks, peak_bytes=d.chunk_bytes, saved_bytes=0)
    return dataclasses.replace(stages, stages=stages.stages[:-1] + (last,))
