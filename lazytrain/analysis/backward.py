"""The memory of a stage's backward: autograd's walk replayed over the stage's nodes.

Needs: a `Graph`, its `costs` (views), the values that carry gradient and what autograd saves
(`saved`). Guarantees: `backward_peak` is the most memory the stage's backward holds at once
of its saved values and of the gradients of its own intermediates, with the running operator's
own workspace (`memory.backward_internal_bytes`) and its weights' gradients made by then, less all
of its weights' gradients; not the gradients of its inputs or outputs. The step model counts those
gradients as buffers of their own (`grad:`, `g:` and resident gradients), the weights' beside this
figure at the backward's event (NOTE: [Weight gradients at the backward's peak]).

NOTE: [Backward memory]
Autograd runs a stage's backward node by node in reverse. At each node the gradient of its result
is live (made by the node's consumers), the gradients of its inputs are made beside it, and then
the result's gradient and whatever only this node saved are freed. A view passes its gradient
through without a copy. The step model used to bound this by everything saved plus the forward's
live peak; on the H200, for a Qwen2.5-7B layer at 32 x 1024 tokens recomputed in its backward,
that bound was 11.2 GiB where the allocator saw 9.25 GiB, and every backward window of a 24 GiB
plan stood 2 GiB over the measured one (the fidelity trace, 2026-11-30).

NOTE: [Weight gradients at the backward's peak]
A stage's backward event counts its workspace beside every gradient it makes, which the plan holds
as buffers of their own (`g:S` or the resident gradients, and `grad:P` of its inputs). Autograd
makes a weight's gradient at the node that reads the weight, so at the backward's peak only those
read after it in forward exist: in a Qwen2.5-7B layer the peak is in the gated MLP, which backward
runs first, where only `down_proj`'s gradient (126 MiB of 444.5 at 32 x 1024) exists. Counting all
of them there, every backward window of the fused 7B plans at 32 x 1024 stood 1.34 GiB over the
measured one (H200, 2026-12-05, 6dc3415; its peak +5 % to +7 % in the rows whose peak is a
backward). So `backward_bytes` is the most the backward holds with the weights' gradients made so
far, less all of them: with them, at the event, the count is the peak's. Its inputs' gradients
(made last) stay counted whole. A compiled backward's kernels may run in another order than its
graph's, so there a weight's gradient counts from the first position its inputs allow
(`fused_transients.peak_bytes`). For that layer eager's count falls 0.31 GiB, the compiled
backward's 0.31 (saving) and 0.43 (recomputed); alone on the H200 the same bodies held 0.12 and 0.29
GiB under the new counts (`bench/stage_memory.py`, e5a3faf, with down_proj's gradient made).

NOTE: [Gradients handed through]
Autograd does not copy every gradient. `add` hands the gradient of its result to both inputs as
the same tensor when neither is broadcast or cast, so a residual stream's gradient is the layer
output's own (the runtime's `grad:S`) until a second gradient reaches it; a second gradient is
then summed in place into a gradient the value owns, or, where the first is shared, into a tensor
of its own, and at that node both parts exist. Counting a copy at each `add`, a Qwen2.5-7B layer's
backward stood 7168 bytes a token over what the allocator held (82944 against 75776 beside its
weights' gradients, bench/stage_memory.py on the H200, 2026-12-01, at 32 x 1024 and 1 x 65536).
"""

from __future__ import annotations

from lazytrain.analysis.memory import backward_internal_bytes
from lazytrain.analysis.saved import saved_internal
from lazytrain.ir.graph import Graph, OpKind, TensorSpec, value_bytes
from lazytrain.passes.costs import NodeCost


def backward_peak(graph: Graph, names: tuple[str, ...], costs: dict[str, NodeCost], rg: frozenset[str],
                  kept: dict[str, set[str]], saved_values: set[str], outputs: tuple[str, ...],
                  accumulating: set[str] = frozenset(), params: frozenset[str] = frozenset()) -> int:
    """NOTE: [Backward memory], less its weights' gradients as NOTE: [Weight gradients at the
    backward's peak] has it: `params` are the stage's own parameters."""
    inside = set(names)

    def base(name: str) -> str:
        while name in costs and costs[name].alias:
            src = next(graph[name].inputs(), None)
            if src is None:
                break
            name = src
        return name

    # saved values live until the last node of this stage that reads them has run backward
    saved = {v: value_bytes(graph[v].value) for v in saved_values}
    readers = {v: set(kept.get(v, ())) & inside for v in saved_values}
    internal = {n: saved_internal(graph[n], graph) for n in names}
    held = sum(saved.values()) + sum(internal.values())
    # NOTE: [Gradients handed through]: base value -> the tensor holding its gradient, by id; a
    # stage output's gradient is a buffer of its own (`grad:S`), here a tensor of 0 bytes
    grads: dict[str, int] = {}
    sizes: dict[int, int] = {}

    def tensor(nbytes: int) -> int:
        sizes[len(sizes)] = nbytes
        return len(sizes) - 1

    def live() -> int:
        return sum(sizes[k] for k in set(grads.values()))

    def narrowed(name: str, b: str) -> bool:
        """`name` is a slice of `b`, through views: its gradient is padded to `b`'s size."""
        while name != b and name in costs and costs[name].alias:
            if graph[name].target == "aten.slice.Tensor":
                return True
            name = next(graph[name].inputs(), b)
        return False

    def widened(name: str, b: str) -> int:
        """Bytes of the widest `expand` on the views from `name` to `b` that grows its input: the
        gradient arrives at that size and is summed down to `b`'s after (NOTE: [Backward
        temporaries] in memory.py); 0 if there is none."""
        most = 0
        while name != b and name in costs and costs[name].alias:
            node = graph[name]
            src = next(node.inputs(), b)
            if node.target == "aten.expand.default" and node.spec.numel > graph[src].spec.numel:
                most = max(most, node.spec.nbytes)
            name = src
        return most

    ours = {base(n) for n in names} - {base(o) for o in outputs}
    peak = held
    weights: set[str] = set()  # the parameters whose gradients exist (NOTE: [Weight gradients at the backward's peak])
    weights_made = 0
    for n in reversed(names):
        node = graph[n]
        if node.op is not OpKind.CALL or n not in rg or costs[n].alias:
            continue
        here = {b for b in map(base, node.inputs()) if b in params and b in rg} - weights
        weights |= here
        weights_made += sum(value_bytes(graph[b].value) for b in here)
        through = handed_through(node, graph)
        out = grads.get(base(n))
        new: dict[str, int] = {}
        made = 0  # bytes of gradients this node makes beside the ones it ends up in
        for i in dict.fromkeys(node.inputs()):
            b = base(i)
            if not (i in rg and b in inside and b in ours and graph[b].op is not OpKind.PARAM) or b in new:
                continue
            if b not in grads and i in through:  # the output's gradient itself
                new[b] = out if out is not None else tensor(0)
                continue
            made += widened(i, b)
            if b not in grads:
                new[b] = tensor(value_bytes(graph[b].value))
                made += sizes[new[b]]
                continue
            # a second gradient for `b`, summed into the first: in place where the first is its
            # own, else into a tensor of its own (the first is another value's too); through a
            # slice, the part is the whole base's (slice_backward pads it), summed out of place
            # beside it (NOTE: [Backward temporaries] in memory.py)
            part = value_bytes(graph[b].value)
            made += part * (2 if narrowed(i, b) else 1)
            if sum(1 for k in grads.values() if k == grads[b]) > 1 or sizes[grads[b]] == 0:
                new[b] = tensor(part)
        # a parameter whose gradient exists already (a tied weight a later stage read) gets this
        # node's part as a tensor of its own, added in after
        adding = sum(graph[i].spec.nbytes for i in set(node.inputs()) & accumulating)
        peak = max(peak, held + live() + made + backward_internal_bytes(node, graph) + adding + weights_made)
        grads.update(new)
        grads.pop(base(n), None)
        held -= internal.pop(n, 0)
        for v in list(readers):
            readers[v].discard(n)
            if not readers[v]:
                held -= saved.pop(v)
                del readers[v]
    return peak - weights_made


def handed_through(node, graph: Graph) -> set[str]:
    """The inputs whose gradient autograd hands over as the node's output gradient itself, with
    no copy: both sides of an `add` of the output's shape and dtype (NOTE: [Gradients handed
    through])."""
    if node.target != "aten.add.Tensor" or dict(node.kwargs).get("alpha", 1) != 1 or not isinstance(node.value, TensorSpec):
        return set()
    ins = list(node.inputs())
    if len(set(ins)) != len(ins):
        return set()
    return {i for i in ins if isinstance(graph[i].value, TensorSpec)
            and graph[i].spec.shape == node.value.shape and graph[i].spec.dtype == node.value.dtype}
