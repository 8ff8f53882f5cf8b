"""Pass `chunk`: run the last stage (final norm, lm_head, loss) in chunks of rows or of tokens.

Needs: the `Graph` and its `Stages` (from `blocks`). Guarantees: the same stages, except that when
the last stage's working set is over `limit` bytes and the stage provably keeps the split
positions apart, the last stage carries `chunks=k` and memory figures for one chunk: `peak_bytes`
is one chunk's working set, `saved_bytes` and `internal_bytes` are 0, since its forward and
backward run together, chunk by chunk, in its backward window (NOTE: [Chunked loss] in
runtime/chunked.py). Otherwise the stages come back unchanged (k = 1). Two ways to cut:
  - along rows: k divides the batch B, each chunk B/k whole rows; chosen when some k brings a
    chunk within the limit;
  - along tokens: each row cut into pieces of `chunk_len` consecutive positions (the last may be
    shorter), k = B * pieces per row; chosen when rows are not enough (batch 1, long sequences).

    epilogue  saved=31.8 GB peak=29.9 GB   (batch 32; logits 32768 x 152064)
      -> epilogue chunks=32 saved=0 peak=2.0 GB                      (rows)
    epilogue  peak=79.7 GB saved=41.7 GB internal=39.9 GB  (batch 1 x 65536; logits 65536 x 152064, bf16)
      -> epilogue chunks=115 chunk_len=570 peak=1.0 GiB             (tokens; working set 123.4 GB / 115)

The proof: every tensor that depends on the batch (a batch input or a stage input) is cut at the
same positions, and every operator keeps those positions apart (the rules in analysis/chunk_rules.py):
  - the loss is `cross_entropy_loss` with reduction mean, no class weights and no label smoothing:
    then mean = (sum of the per-target losses) / (number of targets not equal to ignore_index), and
    both sums split over chunks exactly;
  - the stage's nodes that read batch inputs alone (Hugging Face's label shift: pad the labels
    with -100, drop the first position) run once for the whole batch (`whole`): they need no
    proof, since their results are cut like any batch input and every later node lines positions
    up one for one, as the whole stage would;
  - every other node's op is in `RULES` and its rule accepts how it uses the batch; every
    batch-dependent tensor is laid out as the runtime cuts it (`Split.laid_out`).
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from lazytrain.analysis.chunk_rules import LOSS_OP, MEAN, RULES, SUM, Ctx, Split, loss_args, loss_rule
from lazytrain.ir.graph import Graph, OpKind, TensorSpec, value_bytes
from lazytrain.ir.stages import Stage, Stages
from lazytrain.passes.costs import RULES as COST_RULES

__all__ = ["LOSS_CHUNK_BYTES", "MEAN", "SUM", "Decision", "chunk", "choose_chunks", "choose_tokens", "decide",
           "loss_args", "provable", "whole_nodes", "working_bytes"]

LOSS_CHUNK_BYTES = 1 << 30  # default largest working set of one chunk of the last stage


@dataclass(frozen=True, slots=True)
class Decision:
    chunks: int
    reason: str  # why the stage is (not) chunked, and how, for the dump and tests
    chunk_bytes: int  # working set of one chunk (`working_bytes` / chunks), plus what does not shrink
    chunk_len: int = 0  # >0: cut along tokens, this many positions of one row per chunk
    whole: tuple[str, ...] = ()  # nodes run once for the whole batch


def working_bytes(stage: Stage) -> int:
    """The stage's forward and backward together: its forward's live peak, or what its forward
    saves, the gradients of as much, and its operators' own workspace (NOTE: [Operator workspace])."""
    return max(stage.peak_bytes, 2 * stage.saved_bytes + stage.internal_bytes)


def _batch_shape(graph: Graph) -> tuple[int | None, int | None]:
    """(rows, positions) every batch input shares: (B, T) for [B, T] token batches, (B, None) when
    they share only the leading dimension, (None, None) when not even that."""
    shapes = [n.spec.shape for n in graph.of(OpKind.INPUT)]
    rows = {s[0] if s else None for s in shapes}
    if len(rows) != 1 or None in rows:
        return None, None
    seq = {s[1] if len(s) > 1 else None for s in shapes}
    return rows.pop(), (seq.pop() if len(seq) == 1 else None)


def whole_nodes(graph: Graph, stage: Stage) -> tuple[str, ...]:
    """The stage's nodes that read batch inputs alone (through each other): no parameter, no stage
    input. They run once, before the chunks."""
    found: set[str] = set()
    for name in stage.nodes:
        refs = list(graph[name].inputs())
        if name != graph.output and refs and all(graph[r].op is OpKind.INPUT or r in found for r in refs):
            found.add(name)
    return tuple(n for n in stage.nodes if n in found)


def provable(graph: Graph, stage: Stage, split: Split, whole: tuple[str, ...] = ()) -> tuple[str | None, set[str]]:
    """(None, batch-dependent nodes) when every operator of `stage` outside `whole` keeps the
    positions `split` cuts apart, else (why not, {})."""
    if stage.outputs != (graph.output,) or graph[graph.output].target != LOSS_OP:
        return f"the stage's output is not only a {LOSS_OP} loss", set()
    skip = set(whole)
    body = [n for n in stage.nodes if n not in skip]
    cut = set(stage.inputs) | {p for p in stage.placeholders if graph[p].op is OpKind.INPUT}
    cut |= {r for n in body for r in graph[n].inputs() if r in skip}  # whole results the chunks read
    for name in sorted(cut):
        spec = graph[name].value
        if not isinstance(spec, TensorSpec) or not split.laid_out(spec) or (
                name in stage.inputs and split.tokens and split.lead(spec) != 2):
            return f"{name} ({spec}) is not laid out as {split.layout()}", set()
    batched = set(cut)
    ctx = Ctx(graph, split, batched)
    for name in body:
        node = graph[name]
        if any(i in batched for i in node.inputs()):
            batched.add(name)
        if name == graph.output:
            why = loss_rule(node, ctx)
        elif node.op is OpKind.GETITEM:
            why = None  # an element of a node already checked
        elif node.target not in RULES:
            why = f"{node.target} is not known to be {split.unit}"
        else:
            why = RULES[node.target](node, ctx) if name in batched else None
        if why:
            return f"{name}: {why}", set()
        specs = node.value if isinstance(node.value, tuple) else (node.value,)
        for spec in specs if name in batched and name != graph.output else ():
            if spec is not None and not split.laid_out(spec):
                return f"{name}: {spec} is not laid out as {split.layout()}", set()
    return None, batched


def choose_chunks(batch: int, working: int, limit: int) -> int:
    """The fewest chunks, a divisor of `batch`, that bring `working` bytes to at most `limit` (or
    `batch` chunks when none does); 1 when `working` fits already or chunking is off (limit 0)."""
    if limit <= 0 or batch <= 1 or working <= limit:
        return 1
    return next((k for k in range(2, batch + 1) if batch % k == 0 and math.ceil(working / k) <= limit), batch)


def choose_tokens(rows: int, seq: int, working: int, limit: int) -> int:
    """Positions per chunk when each row is cut into pieces: the longest that keeps one chunk's
    share of `working` (spread evenly over rows x seq tokens) within `limit`, then evened out over
    the pieces a row needs (so the last piece is not a sliver); at least 1."""
    longest = max(1, min(seq, limit * rows * seq // max(working, 1)))
    pieces = -(-seq // longest)
    return -(-seq // pieces)


def _tokens_bytes(working: int, rows: int, seq: int, n: int) -> int:
    return -(-working * n // (rows * seq))


def decide(graph: Graph, stages: Stages, limit: int = LOSS_CHUNK_BYTES) -> Decision:
    """How the last stage is cut (rows or tokens, how many chunks), why, and one chunk's working set."""
    last = stages[len(stages) - 1]
    working = working_bytes(last)
    if limit <= 0:
        return Decision(1, "off", working)
    if working <= limit:
        return Decision(1, f"its working set ({working} bytes) is within the limit ({limit})", working)
    rows, seq = _batch_shape(graph)
    if rows is None:
        return Decision(1, "the batch inputs do not share a leading dimension", working)
    whole = whole_nodes(graph, last)
    why_rows, batched = provable(graph, last, Split(rows), whole) if rows > 1 else (
        f"a batch of {rows} row cannot be cut into rows", set())
    k = choose_chunks(rows, working, limit) if not why_rows else 1
    if not why_rows and math.ceil(working / k) <= limit:
        return _along_rows(graph, last, rows, k, working, whole, batched)
    if seq is None or seq <= 1:
        why_tokens, tok_batched = "the batch inputs do not share a sequence dimension above 1", set()
    else:
        why_tokens, tok_batched = provable(graph, last, Split(rows, seq), whole)
    if not why_tokens:
        n = choose_tokens(rows, seq, working, limit)
        pieces = -(-seq // n)
        fixed = _fixed_bytes(graph, last, tok_batched, whole)
        return Decision(rows * pieces, f"{rows * pieces} chunks along tokens: {rows} row(s) x {pieces} pieces of "
                        f"{n} positions", _tokens_bytes(working, rows, seq, n) + fixed, n, whole)
    if not why_rows:  # the finest cut into rows, still over the limit
        d = _along_rows(graph, last, rows, k, working, whole, batched)
        return dataclasses.replace(d, reason=f"{d.reason}; not along tokens: {why_tokens}")
    return Decision(1, f"along rows: {why_rows}; along tokens: {why_tokens}", working)


def _fixed_bytes(graph: Graph, stage: Stage, batched: set[str], whole: tuple[str, ...]) -> int:
    """What does not shrink with the chunks: nodes that do not depend on the batch are as large in
    every chunk (counted twice, like saved tensors and their gradients); the whole part's results
    stay for every chunk (integers: no gradient)."""
    skip = set(whole)
    own = [n for n in stage.nodes if not getattr(COST_RULES.get(graph[n].target), "alias", False)]
    return (2 * sum(value_bytes(graph[n].value) for n in own if n not in batched and n not in skip)
            + sum(value_bytes(graph[n].value) for n in own if n in skip))


def _along_rows(graph, last, rows, k, working, whole, batched) -> Decision:
    fixed = _fixed_bytes(graph, last, batched, whole)
    return Decision(k, f"{k} chunks along rows: {rows // k} row(s) each", math.ceil(working / k) + fixed, 0, whole)


# NOTE: [Chunk gradient sums] Each chunk's backward makes the gradient of every weight the stage
# reads anew and autograd adds it into the earlier chunks' sum: k - 1 additions that read two and
# write one weight-sized tensor. Measured on the H200 (`bench/opcost.py`, 2026-11-30): 11.3 ms of the
# 1.5B's 76 ms loss stage (32 chunks), 57.7 of the 7B's 276 (64 chunks), at 3.6-3.9 TB/s; counted at
# the profile's elementwise rate (`Hardware.bytes_per_s`, the conversions') they are 1.3-1.5x over.
def chunk(stages: Stages, d: Decision, bytes_per_s: float) -> Stages:
    """The stages with `decide`'s decision applied to the last one, its backward charged the
    gradient sums over chunks (NOTE: [Chunk gradient sums])."""
    if d.chunks == 1:
        return stages
    g = stages[len(stages) - 1]
    sums = (d.chunks - 1) * 3 * stages.weight_bytes(len(stages) - 1) / bytes_per_s
    last = dataclasses.replace(g, chunks=d.chunks, chunk_len=d.chunk_len, whole=d.whole, bwd_s=g.bwd_s + sums,
                               peak_bytes=d.chunk_bytes, saved_bytes=0, internal_bytes=0)
    return dataclasses.replace(stages, stages=stages.stages[:-1] + (last,))
