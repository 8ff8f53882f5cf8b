"""Per-op rules of pass `chunk`: does an operator keep the split positions apart?

A chunked stage cuts every tensor that depends on the batch at the same positions, along its
*split dimensions*: the leading dimension (rows) when split along rows; when split along tokens,
the rows and sequence positions, either still apart (`[B, T, ...]`, dims 0 and 1) or flattened
row-major (`[B*T, ...]`, dim 0). An operator is safe when each element of its result at a split
position depends only on its batch operands at that same position: it computes, reduces,
normalises, views and pads along the other dimensions only, and operands that do not depend on
the batch broadcast over the split dimensions. Each rule returns None (safe) or why not.
The rules err on the side of refusing: an op not listed, or used in a way a rule cannot prove
safe, leaves the stage unchunked (the reason is in the `--dump-ir` file of the pass).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable

from lazytrain.ir.graph import Graph, Node, Sym, TensorSpec

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
class Split:
    """How the stage is cut: along `rows` rows, or (`seq` > 0) along rows x `seq` positions."""

    rows: int
    seq: int = 0

    @property
    def tokens(self) -> bool:
        return self.seq > 0

    @property
    def unit(self) -> str:
        return "per-token" if self.tokens else "row-wise"

    def lead(self, spec: TensorSpec) -> int:
        """How many leading dimensions of a batch-dependent tensor are split dimensions."""
        if self.tokens and len(spec.shape) >= 2 and spec.shape[:2] == (self.rows, self.seq):
            return 2
        return 1

    def laid_out(self, spec: TensorSpec) -> bool:
        """The tensor's leading dimensions are cut the way the runtime cuts them (NOTE: [Chunked loss]
        in runtime/chunked.py): rows leading (a multiple of the batch), or the tokens apart or flat."""
        if not spec.shape:
            return False
        if self.tokens:
            return self.lead(spec) == 2 or spec.shape[0] == self.rows * self.seq
        return spec.shape[0] % self.rows == 0

    def layout(self) -> str:
        return f"[{self.rows}, {self.seq}, ...] or [{self.rows * self.seq}, ...]" if self.tokens \
            else f"a multiple of {self.rows} rows leading"

    def dim_name(self, spec: TensorSpec, d: int) -> str:
        if not self.tokens:
            return "batch"
        return ("batch", "sequence")[d] if self.lead(spec) == 2 else "token"


class Ctx:
    def __init__(self, graph: Graph, split: Split, batched: set[str]):
        self.graph, self.split, self.batched = graph, split, batched

    def spec(self, arg) -> TensorSpec | None:
        if isinstance(arg, Sym) and arg.kind == "ref" and isinstance(self.graph[arg.value].value, TensorSpec):
            return self.graph[arg.value].value
        return None

    def is_batched(self, arg) -> bool:
        return isinstance(arg, Sym) and arg.kind == "ref" and arg.value in self.batched

    def touches(self, dims, spec: TensorSpec, what: str) -> str | None:
        """Why not, when `dims` (None or () for all) include a split dimension of `spec`."""
        if dims is None or (isinstance(dims, tuple) and not dims):
            return f"{what} over every dimension"
        lead = self.split.lead(spec)
        hit = sorted({_dim(d, len(spec.shape)) for d in (dims if isinstance(dims, tuple) else (dims,))} & set(range(lead)))
        return f"{what} over the {self.split.dim_name(spec, hit[0])} dimension" if hit else None


Rule = Callable[[Node, Ctx], str | None]  # None: safe; else why not
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
def _elementwise(node: Node, ctx: Ctx) -> str | None:
    """Batch operands line up with the output position for position; other operands broadcast over
    the split dimensions (right-aligned, as torch broadcasts: absent there, or of size 1)."""
    out = node.value
    lead = ctx.split.lead(out)
    for a in (*node.args, *(v for _, v in node.kwargs)):
        spec = ctx.spec(a)
        if spec is None:
            continue
        if ctx.is_batched(a):
            if len(spec.shape) != len(out.shape) or spec.shape[:lead] != out.shape[:lead]:
                return f"{a.value} {spec} and the output {out} do not line up position for position"
            continue
        offset = len(out.shape) - len(spec.shape)
        if any(d - offset >= 0 and spec.shape[d - offset] != 1 for d in range(lead)):
            return f"{a.value} {spec} does not depend on the batch but spans the output's leading dimension"
    return None


@rule("mean.dim", "sum.dim_IntList", "amax.default", "logsumexp.default")
def _reduce(node: Node, ctx: Ctx) -> str | None:
    return ctx.touches(_arg(node, 1, "dim"), ctx.spec(node.args[0]), "reduces")


@rule("softmax.int", "_softmax.default", "log_softmax.int", "_log_softmax.default")
def _softmax(node: Node, ctx: Ctx) -> str | None:
    return ctx.touches(_arg(node, 1, "dim"), ctx.spec(node.args[0]), "normalises")


@rule("layer_norm.default", "rms_norm.default")
def _norm(node: Node, ctx: Ctx) -> str | None:
    if not ctx.is_batched(node.args[0]):
        return "the batch operand is not the normalised one"
    x = ctx.spec(node.args[0])
    if len(_arg(node, 1, "normalized_shape")) > len(x.shape) - ctx.split.lead(x):
        return "normalises over the batch dimension"
    return _weights_only(node, ctx, skip=1)


def _tiled_norm(node: Node, ctx: Ctx) -> str | None:
    """lazytrain::rms_norm (NOTE: [Tiled RMSNorm]) normalises each row over its last dimension alone."""
    if not ctx.is_batched(node.args[0]):
        return "the batch operand is not the normalised one"
    x = ctx.spec(node.args[0])
    if len(x.shape) - 1 < ctx.split.lead(x):
        return "normalises over the batch dimension"
    return _weights_only(node, ctx, skip=1)


RULES["lazytrain.rms_norm.default"] = _tiled_norm


def _weights_only(node: Node, ctx: Ctx, skip: int) -> str | None:
    """Operands after the first `skip` must not depend on the batch (weights, biases)."""
    rest = (*node.args[skip:], *(v for _, v in node.kwargs))
    batched = [a.value for a in rest if ctx.is_batched(a)]
    return f"mixes rows through {batched[0]}" if batched else None


@rule("linear.default", "mm.default", "matmul.default")
def _matmul(node: Node, ctx: Ctx) -> str | None:
    x = ctx.spec(node.args[0])
    if not ctx.is_batched(node.args[0]) or x is None or len(x.shape) <= ctx.split.lead(x):
        return "the batch operand is not the first, or has no row dimension"
    w = ctx.spec(node.args[1])
    if node.target == "aten.matmul.default" and (w is None or len(w.shape) > 2):
        return "a batched matmul broadcasts over the leading dimension"
    return _weights_only(node, ctx, skip=1)


@rule("view.default", "reshape.default", "_unsafe_view.default")
def _view(node: Node, ctx: Ctx) -> str | None:
    shape = node.args[1]
    if not shape or shape[0] != -1:  # a chunk has fewer rows: only -1 adapts to it
        return f"the new shape {list(shape)} fixes the leading dimension"
    if ctx.split.tokens:  # the -1 must take exactly the split dimensions: a chunk's positions, flattened
        x = ctx.spec(node.args[0])
        if -1 in shape[1:] or math.prod(shape[1:]) != math.prod(x.shape[ctx.split.lead(x):]):
            return f"the new shape {list(shape)} of {x} does not keep the positions apart from the other dimensions"
    return None


@rule("flatten.using_ints")
def _flatten(node: Node, ctx: Ctx) -> str | None:
    if not ctx.split.tokens:
        return None  # merges dimensions without naming sizes; the leading-dimension check does the rest
    x = ctx.spec(node.args[0])
    lead, ndim = ctx.split.lead(x), len(x.shape)
    start, end = _dim(_arg(node, 1, "start_dim", 0), ndim), _dim(_arg(node, 2, "end_dim", -1), ndim)
    return None if start >= lead or (start == 0 and end == lead - 1) else "merges the positions with other dimensions"


@rule("unsqueeze.default", "squeeze.dim", "select.int")
def _one_dim(node: Node, ctx: Ctx) -> str | None:
    spec = node.value if node.target == "aten.unsqueeze.default" else ctx.spec(node.args[0])
    x = ctx.spec(node.args[0])
    return "works on the batch dimension" if _dim(node.args[1], len(spec.shape)) < ctx.split.lead(x) else None


@rule("transpose.int")
def _transpose(node: Node, ctx: Ctx) -> str | None:
    x = ctx.spec(node.args[0])
    ndim, lead = len(x.shape), ctx.split.lead(x)
    return "moves the batch dimension" if min(_dim(node.args[1], ndim), _dim(node.args[2], ndim)) < lead else None


@rule("permute.default")
def _permute(node: Node, ctx: Ctx) -> str | None:
    x = ctx.spec(node.args[0])
    ndim, lead = len(x.shape), ctx.split.lead(x)
    return "moves the batch dimension" if [_dim(d, ndim) for d in node.args[1][:lead]] != list(range(lead)) else None


@rule("slice.Tensor")
def _slice(node: Node, ctx: Ctx) -> str | None:
    x = ctx.spec(node.args[0])
    dim, start, end, step = (_arg(node, i, name, default) for i, name, default in
                             ((1, "dim", 0), (2, "start", None), (3, "end", None), (4, "step", 1)))
    dim = _dim(dim, len(x.shape))
    whole = start in (None, 0) and (end is None or end >= x.shape[dim]) and step == 1
    return None if dim >= ctx.split.lead(x) or whole else f"slices the {ctx.split.dim_name(x, dim)} dimension"


@rule("pad.default", "constant_pad_nd.default")
def _pad(node: Node, ctx: Ctx) -> str | None:
    x = ctx.spec(node.args[0])
    return "pads the batch dimension" if len(node.args[1]) // 2 > len(x.shape) - ctx.split.lead(x) else None


def loss_rule(node: Node, ctx: Ctx) -> str | None:
    a = loss_args(node)
    if a.weight is not None or a.reduction != MEAN or a.label_smoothing != 0.0:
        return (f"the loss has weight={a.weight}, reduction={a.reduction}, label_smoothing={a.label_smoothing} "
                "(only an unweighted mean without label smoothing splits into per-chunk sums)")
    x, t = ctx.spec(a.input), ctx.spec(a.target)
    if not (ctx.is_batched(a.input) and ctx.is_batched(a.target)) or x is None or t is None:
        return "the loss's input or target does not depend on the batch"
    if t.is_float or len(x.shape) < 2 or x.shape[0] != t.shape[0]:
        return f"the loss's input {x} and target {t} are not class indices, row for row"
    if ctx.split.tokens and (len(x.shape) != 2 or ctx.split.lead(x) != 1):
        return f"the loss's input {x} does not hold one token's classes per row"
    return None
