"""Whether a model keeps the sequences packed into one row apart: checked on its captured step
before anything is compiled (NOTE: [Document boundaries reach attention]).

NOTE: [Document boundaries reach attention]
Packed rows (NOTE: [Packing] in packing.py) say where each sequence starts only through
``position_ids``. A model that ignores them trains each sequence on the ones before it in its row:
no error, a quietly worse model. So before a run packs, the step is captured as it will be compiled
(on the meta device: no weights, any size) and its graph must show that:

1. it has at least one attention operator;
2. every attention operator's mask is computed from ``position_ids``: for a fused one (any operator
   named for attention: scaled_dot_product_attention and its kernels, flash-attn's, flex
   attention), some operand besides query, key and value depends on them; for attention written
   out (a softmax over ``[..., seq, seq]`` scores), they reach the softmax's input by a path that
   does not go through the query-key product (a contraction's product operands are cut), so
   rotary embeddings, which reach the scores only through that product, do not count;
3. every block (``model.layers.N``) has such an attention operator: a block without one mixes
   tokens some other way (linear attention, state-space layers) or not at all;
4. no operator mixes tokens without a mask: no convolution and no running sum, product or scan
   over floating-point values, the ways linear-attention and state-space layers carry state along
   the sequence (the integer running sum that builds a mask from positions is fine).

Why the graph and not a run: a run on a tiny input needs the model's weights and a small copy of
its architecture, which a model file does not offer, and proves one input; the graph is the step
that will be trained, whatever its size, and a failure names the operator and its module. What it
does not prove is that the mask is the right function of the positions: Hugging Face decoders
build it from them (masking_utils' packed-sequence mask, with sliding windows and chunks remapped
to positions), and a model directory's attention is the document attention operator, which reads
them itself (NOTE: [Document attention] in kernels/documents.py); tests/test_packing_grads.py
checks both against examples run alone for four families. Token mixing by other means (a shift written as slicing and padding) is not detected.
"""

from __future__ import annotations

import re

from lazytrain.errors import TraceError
from lazytrain.ir.graph import Graph, Node, OpKind

POSITIONS = "position_ids"
_FUSED = re.compile(r"attention|attn", re.IGNORECASE)
_SOFTMAX = frozenset({"aten.softmax.int", "aten._softmax.default", "aten._safe_softmax.default"})
# contractions: the product of their operands is cut; those listed keep the operands before it
_CONTRACTIONS = {"aten.bmm.default": 0, "aten.mm.default": 0, "aten.matmul.default": 0, "aten.linear.default": 0,
                 "aten.einsum.default": 0, "aten.baddbmm.default": 1, "aten.addmm.default": 1, "aten.addbmm.default": 1}
_MIXERS = re.compile(r"^_*(conv(olution)?(\d?d|_\w+)?|cumsum|cumprod|logcumsumexp|\w*scan|while_loop)$")


def check_boundaries(graph: Graph, seq_len: int, source: str, fix: str) -> None:
    """Raise ``TraceError`` unless ``graph`` keeps packed sequences apart (NOTE: [Document
    boundaries reach attention]); ``fix`` is the flag that trains without packing."""
    refuse = f"so sequences packed into one row would see each other; {fix}"
    reaches, direct = _reach(graph)
    attention = [n for n in graph.of(OpKind.CALL) if _is_attention(n, seq_len, graph)]
    if not attention:
        raise TraceError(f"{source} has no attention operator that position_ids could mask, {refuse}")
    for node in attention:
        if node.target in _SOFTMAX:
            masked = any(direct[i] for i in node.inputs())
        else:
            masked = any(reaches[i] for i in _refs(node.args[3:]) + _refs(tuple(v for _, v in node.kwargs)))
        if not masked:
            raise TraceError(f"{source}: attention {node.target} in {node.module or 'the model'} takes no mask "
                             f"computed from position_ids, {refuse}")
    for node in graph.of(OpKind.CALL):
        if _MIXERS.match(_op_name(node.target)) and _floating(node):
            raise TraceError(f"{source}: {node.target} in {node.module or 'the model'} mixes tokens along the "
                             f"sequence with no mask (as linear-attention and state-space layers do), {refuse}")
    blocks = dict.fromkeys(n.block for n in graph if n.block is not None)
    unmasked = [b for b in blocks if b not in {n.block for n in attention}]
    if unmasked:
        raise TraceError(f"{source}: block {unmasked[0]} has no attention operator (a linear-attention or "
                         f"state-space layer mixes tokens without a mask), {refuse}")


def _is_attention(node: Node, seq_len: int, graph: Graph) -> bool:
    name = node.target.lower()
    if node.target in _SOFTMAX:
        shape = graph[next(node.inputs())].value.shape if node.args else ()
        return len(shape) >= 2 and shape[-1] == shape[-2] == seq_len
    return bool(_FUSED.search(name)) and "backward" not in name


def _reach(graph: Graph) -> tuple[dict[str, bool], dict[str, bool]]:
    """For each node: whether position_ids reach it at all, and without a contraction's product."""
    reaches: dict[str, bool] = {}
    direct: dict[str, bool] = {}
    for node in graph:
        if node.op is OpKind.INPUT:
            reaches[node.name] = direct[node.name] = node.target == POSITIONS
            continue
        inputs = list(node.inputs())
        reaches[node.name] = any(reaches[i] for i in inputs)
        kept = _CONTRACTIONS.get(node.target)
        through = inputs if kept is None else list(_refs(node.args[:kept]))
        direct[node.name] = any(direct[i] for i in through)
    return reaches, direct


def _op_name(target: str) -> str:
    """``aten.cumsum.default`` -> ``cumsum``."""
    parts = target.split(".")
    return parts[1] if len(parts) > 1 else target


def _refs(args: tuple) -> list[str]:
    return list(Node("", OpKind.CALL, "", args=args).inputs())


def _floating(node: Node) -> bool:
    values = node.value if isinstance(node.value, tuple) else (node.value,)
    return any(v is not None and v.is_float for v in values)
