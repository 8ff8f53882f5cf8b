"""A constant attention mask, proven causal (or not) in O(S log S), exactly, without materialising it.

NOTE: [Masks by rows of intervals]
Transformers builds its masks from index vectors: a query-side vector ([..., Q, 1]: the query's
position, its document, its window start) and a key-side vector ([..., 1, K]), compared, and the
comparisons combined with and/or/not, so every [Q, K] value is elementwise over broadcasts of
O(S) vectors. Row i of such a mask is a union of intervals of keys: a comparison of a key vector
that is monotone in j with a query's value holds on a prefix, a suffix or one interval of j (a
`searchsorted` into the key vector), and and/or/not of a few intervals is a few intervals. So each
[Q, K] value is kept as, per row, its sorted breakpoints and the value on each segment between
them: O(Q x breakpoints) memory, never Q x K. The result is then compared, segment by segment,
with the causal mask (keys 0..i in row i). Every step is exact integer and boolean arithmetic on
the values the graph itself computes (the vectors are evaluated with the same ATen operators), so
this is a proof, as evaluating the whole mask is, not a pattern match.

What it does not express (a key vector that is not monotone, an integer [Q, K] value such as
q_idx - kv_idx, a float mask, batch-dependent slices) returns None: pass `causal` then falls back to
evaluating the mask, whole or a block of rows at a time. At 1 x 131,072 tokens that evaluation took
345 s of a 357 s compile (H200 box, 2026-12-02); this analysis reads 1 x 1,048,576 in about a second.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lazytrain.ir.graph import Graph, Node, OpKind

_COMPARE = {"le": torch.le, "lt": torch.lt, "ge": torch.ge, "gt": torch.gt, "eq": torch.eq, "ne": torch.ne}
_SWAP = {"le": "ge", "lt": "gt", "ge": "le", "gt": "lt", "eq": "eq", "ne": "ne"}  # a OP b == b SWAP[OP] a
_AND = {"aten.__and__.Tensor", "aten.bitwise_and.Tensor", "aten.logical_and.default"}
_OR = {"aten.__or__.Tensor", "aten.bitwise_or.Tensor", "aten.logical_or.default"}
_NOT = {"aten.logical_not.default", "aten.bitwise_not.default"}
_SAME = {"aten.to.dtype", "aten.to.dtype_layout", "aten._to_copy.default", "aten.expand.default", "aten.clone.default",
         "aten.alias.default"}
MAX_BREAKPOINTS = 64  # per row: past this, a mask is not a few intervals a row and is left to evaluation


class Unsupported(Exception):
    """The mask is built in a way this analysis does not express: no answer, no rewrite."""


@dataclass(frozen=True)
class Rows:
    """A [Q, K] boolean as intervals per row: row i is `values[i, k]` on keys j with
    `points[i, k-1] <= j < points[i, k]` (points sorted; segment 0 starts at key 0, the last ends at K)."""
    points: torch.Tensor  # int64 [Q, m]
    values: torch.Tensor  # bool [Q, m + 1]

    def at(self, keys: torch.Tensor) -> torch.Tensor:
        """The value at keys [Q, n] of each row: its segment is the count of breakpoints at or
        before the key (a broadcast count: a row's few breakpoints beat a batched binary search)."""
        return self.values.gather(1, (keys[:, :, None] >= self.points[:, None, :]).sum(-1))


def _constant_rows(value: torch.Tensor, n_queries: int) -> Rows:
    """A value the same for every key of a row: a query-side boolean [Q] (or a scalar)."""
    return Rows(torch.zeros(n_queries, 0, dtype=torch.int64), value.expand(n_queries).reshape(n_queries, 1))


def _combine(a: Rows, b: Rows, op) -> Rows:
    points = torch.sort(torch.cat([a.points, b.points], 1), 1).values
    starts = torch.cat([torch.zeros(points.shape[0], 1, dtype=torch.int64), points], 1)  # each segment's first key
    values = op(a.at(starts), b.at(starts))
    if points.shape[1] > MAX_BREAKPOINTS:
        raise Unsupported(f"more than {MAX_BREAKPOINTS} intervals a row")
    return Rows(points, values)


def _compare_keys(keys: torch.Tensor, op: str, queries: torch.Tensor) -> Rows:
    """Row i of `keys[j] OP queries[i]`, for a key vector monotone in j."""
    if keys.numel() > 1 and not bool((keys[1:] >= keys[:-1]).all()):
        if bool((keys[1:] <= keys[:-1]).all()):  # decreasing: compare its negation, the other way round
            return _compare_keys(-keys, _SWAP[op], -queries)
        raise Unsupported("a key-side vector that is not monotone")
    lo = torch.searchsorted(keys, queries, right=False)[:, None]  # keys[j] < q  <=>  j < lo
    hi = torch.searchsorted(keys, queries, right=True)[:, None]  # keys[j] <= q  <=>  j < hi
    true, false = torch.ones_like(lo, dtype=torch.bool), torch.zeros_like(lo, dtype=torch.bool)
    match op:
        case "lt":
            return Rows(lo, torch.cat([true, false], 1))
        case "le":
            return Rows(hi, torch.cat([true, false], 1))
        case "gt":
            return Rows(hi, torch.cat([false, true], 1))
        case "ge":
            return Rows(lo, torch.cat([false, true], 1))
        case "eq":
            return Rows(torch.cat([lo, hi], 1), torch.cat([false, true, false], 1))
        case _:
            return Rows(torch.cat([lo, hi], 1), torch.cat([true, false, true], 1))


def _side(value, n_queries: int, n_keys: int) -> tuple[str, torch.Tensor]:
    """A small operand of a [Q, K] value: ("query", [Q]), ("key", [K]) or ("scalar", [])."""
    if not isinstance(value, torch.Tensor):
        return "scalar", torch.tensor(value)
    if value.dim() > 2 and any(d != 1 for d in value.shape[:-2]):  # batch or heads: one slice if all are equal
        slices = value.reshape(-1, *value.shape[-2:])
        if not bool((slices == slices[:1]).all()):
            raise Unsupported("a mask that differs across batch or heads")
        value = slices[0]
    last = tuple(value.shape[-2:]) if value.dim() >= 2 else (1,) + tuple(value.shape)
    if value.numel() == 1:
        return "scalar", value.reshape(())
    if last == (n_queries, 1):
        return "query", value.reshape(n_queries)
    if last == (1, n_keys):
        return "key", value.reshape(n_keys)
    raise Unsupported(f"an operand of shape {tuple(value.shape)}")


def _rows_of(value, n_queries: int, n_keys: int) -> Rows:
    """A boolean operand as `Rows`: already one, query-side or scalar, or a key-side vector (a few
    intervals, the same for every row)."""
    if isinstance(value, Rows):
        return value
    side, v = _side(value, n_queries, n_keys)
    if v.dtype != torch.bool:
        raise Unsupported("a non-boolean [Q, K] value")
    if side != "key":
        return _constant_rows(v, n_queries)
    points = (torch.nonzero(v[1:] != v[:-1]).flatten() + 1)
    if points.numel() > MAX_BREAKPOINTS:
        raise Unsupported(f"a key-side boolean of more than {MAX_BREAKPOINTS} intervals")
    values = torch.cat([v[:1], v[points]])
    return Rows(points.expand(n_queries, -1).contiguous(), values.expand(n_queries, -1).contiguous())


def mask_rows(graph: Graph, nodes: list[Node], name: str, n_queries: int, n_keys: int, evaluate) -> Rows:
    """The constant mask `name` as `Rows`: `nodes` are its producers in graph order (no input,
    parameter or buffer among them); `evaluate(node, env)` computes a small one's value. Raises
    `Unsupported` where NOTE: [Masks by rows of intervals] does not apply."""
    def large(n: Node) -> bool:
        shape = getattr(n.value, "shape", None)
        return shape is not None and len(shape) >= 2 and tuple(shape[-2:]) == (n_queries, n_keys)

    env: dict[str, object] = {}
    for n in nodes:
        if not large(n):
            if any(isinstance(env.get(i), Rows) for i in n.inputs()):
                raise Unsupported(f"{n.name} reduces a [Q, K] value")
            evaluate(n, env)
            continue
        if n.op is not OpKind.CALL:
            raise Unsupported(f"{n.name}: a [Q, K] value from {n.op.value}")
        args = [env[a.value] if hasattr(a, "kind") and a.kind == "ref" else a for a in n.args]
        ns, op, overload = n.target.split(".")
        if op in _COMPARE:
            if any(isinstance(x, Rows) for x in args[:2]):
                raise Unsupported(f"{n.name}: a comparison of [Q, K] values")
            (sa, a), (sb, b) = (_side(x, n_queries, n_keys) for x in args[:2])
            if {sa, sb} != {"key", "query"}:  # any other comparison is no [Q, K] value: small, evaluated
                raise Unsupported(f"{n.name}: a comparison that is not of a key-side and a query-side value")
            env[n.name] = _compare_keys(a, op, b) if sa == "key" else _compare_keys(b, _SWAP[op], a)
        elif n.target in _AND or n.target in _OR:
            fn = torch.logical_and if n.target in _AND else torch.logical_or
            env[n.name] = _combine(_rows_of(args[0], n_queries, n_keys), _rows_of(args[1], n_queries, n_keys), fn)
        elif n.target in _NOT:
            r = _rows_of(args[0], n_queries, n_keys)
            env[n.name] = Rows(r.points, ~r.values)
        elif n.target in _SAME:
            if n.spec.dtype != "bool":
                raise Unsupported(f"{n.name}: a [Q, K] value that is not boolean")
            env[n.name] = _rows_of(args[0], n_queries, n_keys)
        else:
            raise Unsupported(f"{n.name}: {n.target} on a [Q, K] value")
    out = env[name]
    if not isinstance(out, Rows):
        raise Unsupported("the mask is not a [Q, K] value")
    return out


def is_causal_rows(rows: Rows, n_keys: int) -> bool:
    """Row i true on keys 0..i and false on the rest, segment by segment."""
    n = rows.points.shape[0]
    diagonal = torch.arange(1, n + 1, dtype=torch.int64)[:, None]  # the causal mask's one breakpoint
    causal = Rows(diagonal, torch.tensor([True, False]).expand(n, 2))
    points = torch.sort(torch.cat([rows.points, diagonal], 1), 1).values.clamp(max=n_keys)
    starts = torch.cat([torch.zeros(n, 1, dtype=torch.int64), points], 1)
    real = starts < n_keys  # segments that start inside the keys
    return bool(((rows.at(starts) == causal.at(starts)) | ~real).all())
