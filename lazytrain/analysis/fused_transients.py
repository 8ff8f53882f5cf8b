"""What a stage's compiled body holds in flight, against its eager body (NOTE: [Fused transients]).

    model.layers.1 (Qwen2.5-7B shape, 32 x 1024, bf16): compiled, a forward without autograd
    peaks 0.94 GiB lower (2.75 GiB), a saving forward 2.69 GiB lower (5.22, with the partitioner's
    saved bytes), its backward 2.91 GiB lower (6.66); recomputed, its recompute and backward 8.97

NOTE: [Fused transients]
Inductor turns a chain of element-wise operators into one kernel that writes only the chain's last
value, and writes it into an input's buffer where that input dies there: `silu(gate) * up` in a
gated MLP is one kernel, `silu(gate)` (1.16 GiB for a Qwen2.5-7B layer at 32 x 1024 tokens) never
exists and the product takes `gate`'s memory. Eager PyTorch makes both. The plan's peaks were
eager's liveness, so every window of the fused 7B plans at 24 GiB stood over the allocator's peak
by a constant, 1.12 GiB in forward windows and 1.93-2.44 GiB in backward ones (H200, 2026-12-04,
789563a, `bench/fidelity.py run --fuse-stages`): peaks 5-6 % over, outside the 5 % check.
So the plan counts, per fusable kind, what the compiled body holds fewer. `peak_bytes` replays the
graphs AOTAutograd hands Inductor (one joint graph traced on fake tensors by `fused_saved.trace`,
partitioned twice): eager's with every operator's result made, the compiled ones as Inductor runs
them:
  - an element-wise result (ATen's tag, or a dtype conversion) that is not returned and that only
    element-wise operators and reductions read is computed inside their kernels, never made (where
    several kernels read it, only if it reads at most `REALIZE_READS` buffers, Inductor's
    `realize_reads_threshold`); its inputs live until the last of them runs;
  - element-wise kernels over as many elements that read a common buffer run as one, where the
    earlier one runs, once the later one's inputs are made (horizontal fusion): in a 7B layer's
    backward the gated MLP's `mul` and `silu_backward` run together, and `gate` dies there;
  - a kernel writes into a buffer of its size that dies there and that no kernel joined with it
    reads: one it made, or a saved value AOTAutograd donates to the backward (`donated_inputs`).
A forward without autograd is the eager partition's forward keeping only the stage's outputs. A
backward is replayed from what the forward saved, as the plan counts a backward (NOTE: [Backward
memory] in backward.py): without the gradients of the stage's outputs and inputs, buffers of
their own, and with its weights' as made, less all of them (NOTE: [Weight gradients at the
backward's peak] there). Eager's from the partition that saves what the forward made
(`default_partition`), freeing each at its last reader as autograd's nodes release theirs (a 7B
layer: 9.29 GiB, the plan's own count 9.57); the compiled one from the min-cut partition, each saved
value freed at its last reader too (the compiled backward `del`s its donated inputs as it goes: 6.38
GiB). A recomputed stage whose recompute skips work (NOTE: [Skipped recompute] in
analysis/remat.py) is traced as it runs there (`trace(remat=True)`): its forward saves a fraction
(the 7B layer's 1.32 GiB against 5.00; the partitioner moves the gated MLP's matmuls, whose
products only backward reads, into backward) and its backward peaks higher; the plan counts that
pair at B(s) as `remat_backward_bytes`.
One 7B, 14B and 1.5B layer each, run alone compiled on the H200 (`bench/stage_memory.py --fused`,
2026-12-04, the runtime of e5a3faf), against the plan's figures (GiB; a backward as saved plus its peak above
what the forward left and the output gradient):

  | layer, tokens | forward | saving forward | saved | backward, saved | recompute and backward |
  |---|---|---|---|---|---|
  | 7B, 32 x 1024 | 2.750 (2.750) | 5.222 (5.222) | 5.003 (5.004) | 6.29 (6.66) | 8.31 (8.97) |
  | 14B, 8 x 1024 | 0.578 (0.578) | 1.259 (1.259) | 1.181 (1.181) | 1.57 (1.37) | 1.79 (1.79) |
  | 1.5B, 16 x 1024 | 0.641 (0.641) | 1.196 (1.196) | 1.149 (1.149) | 1.45 (1.56) | 1.98 (2.10) |

The measured backwards hold the weights' gradients they made by their peak, which the plan counts
apart (its `g:S` buffers): a 14B layer's are 0.55 GiB in all, large beside its activations at 8 x
1024 tokens. In the 7B layer's compiled backward (Inductor's code) the peak comes at the gated
MLP's element-wise kernel, where one weight gradient (0.13 GiB) exists: 6.16 GiB as the plan counts. Before this replay the
plan held a compiled backward's inputs to its end (8.16 GiB for the 7B layer, saved or recomputed),
and every backward window of a fused stage that saves its internals stood 2.7 GiB over the
allocator's peak (the 7B with 8-bit states at 24 GiB: peak +9 %, 9a7bace).

NOTE: [Workspace the trace cannot see]
The plan lowers eager's count by the difference of two replays, so each must peak where the
device's body does. An operator's own workspace decides that peak where it is large: attention's
backward keeps its queries' gradient in fp32 and makes the key's and value's gradients at the
queries' heads (3.5 GiB in a 7B layer at 1 x 131,072), which the trace, on the CPU's operators and
fake tensors, cannot see. With its MLP and norms in tiles, that layer's backward peaks there, while
the eager replay without it peaked elsewhere, and also counted the q, k and v projections' one
input three times (the default partition saves a view of it for each). So 1.65 GiB were taken off
a peak they were never part of. On the H200 (2026-12-05, 0248bf9, `bench/fidelity.py run
--fuse-stages`) every backward window of a recomputed layer stood over the plan by 2.24 GiB at 1 x
131,072 (18.32 GiB against 16.08; the row's peak -10 %) and by 4.87 at 1 x 262,144 (37.45 against
32.58). So both replays hold each operator's workspace while it runs (`_kernel_workspace`), and a
fused stage's backward is never counted under the compiled body's own replay: for that layer 9.26
GiB, where eager's count less the difference gave 6.82 (2.44 more; 5.25 more at 262,144). At 32 x
1024, where the untiled MLP sets the peak, the 7B's, 1.5B's and 32B's layers keep their figures and
the 14B's rises 0.10 GiB (1.35).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from lazytrain.analysis.fused_saved import Traced, donated_inputs, saved_inputs
from lazytrain.analysis.memory import dq_accumulator_bytes, gqa_gradients_bytes


def _is_view(node: torch.fx.Node) -> bool:
    t = node.target
    return t is operator.getitem or getattr(t, "is_view", False) or t is torch.ops.aten._unsafe_view.default


def _base(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose memory `node` is: through views and tuple items to the operator that made it."""
    while node.op == "call_function" and _is_view(node) and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _pointwise(node: torch.fx.Node) -> bool:
    """Element-wise: ATen's tag, or a dtype conversion (which Inductor lowers as one)."""
    return node.op == "call_function" and (torch.Tag.pointwise in getattr(node.target, "tags", ())
                                           or node.target is torch.ops.aten._to_copy.default)


# Inductor's reductions: an element-wise value they read is computed inside their kernel
REDUCTIONS = ("sum", "mean", "amax", "amin", "prod", "var", "var_mean", "std")
REALIZE_READS = 4  # Inductor makes a value read by several kernels if it reads more buffers (`realize_reads_threshold`)


def _inlinable(node: torch.fx.Node) -> bool:
    """Whether Inductor computes an element-wise value inside `node`'s kernel rather than reading
    it from memory: `node` is element-wise or a reduction."""
    return _pointwise(node) or (node.op == "call_function" and isinstance(node.target, torch._ops.OpOverload)
                                and node.target.namespace == "aten" and node.target.overloadpacket.__name__ in REDUCTIONS)


def _nbytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return sum(v.untyped_storage().nbytes() for v in vals if isinstance(v, torch.Tensor))


def peak_bytes(graph: torch.fx.Graph, fused: bool, counted_inputs: frozenset[int] = frozenset(),
               held: frozenset[int] = frozenset(), outputs: int | None = None,
               donated: frozenset[int] = frozenset(), returned: bool = True,
               weights: frozenset[int] = frozenset()) -> int:
    """The most bytes `graph`'s values hold at once when its nodes run in order: every operator's
    result (a view is its base's), freed after its last reader; what it returns, to its end. Its
    inputs are left out but for the positions in `counted_inputs`, from its start to their last
    reader, or for those also in `held` to its end. `fused`: the results Inductor fuses away are
    never made, and a kernel writes into a buffer of its size that dies as it runs: one it made, or an
    input whose position is in `donated` (NOTE: [Fused transients]). `outputs`: only the first this
    many returned values are kept (a partitioned forward run without autograd, whose values saved
    for backward die at their last reader). Without `returned`, what it returns is not counted (a
    backward's gradients of the stage's inputs and parameters: buffers the plan counts apart), but
    for the positions in `weights` (its weights' gradients), counted from where they are made and
    taken off the peak after (NOTE: [Weight gradients at the backward's peak] in backward.py)."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    out = next(n for n in nodes if n.op == "output")
    given_back: set = set()
    torch.fx.node.map_arg(out.args[0][:outputs] if outputs is not None else out.args, given_back.add)

    def readers(n):  # the nodes that read n's memory, through views (what is returned is held apart)
        for u in n.users:
            if u.op == "call_function" and _is_view(u):
                yield from readers(u)
            elif u.op != "output":
                yield u

    places = [n for n in nodes if n.op == "placeholder"]
    inputs = {n: _nbytes(n) for i, n in enumerate(places) if i in counted_inputs}
    made = {n: _nbytes(n) for n in nodes if n.op == "call_function" and not _is_view(n)}
    returned_bases = {_base(n) for n in given_back}
    apart: set = set()  # the weights' gradients counted, taken off the peak at the end
    if not returned:
        values = list(out.args[0]) if isinstance(out.args[0], (tuple, list)) else [out.args[0]]
        grads = {_base(v) for i, v in enumerate(values) if i in weights and isinstance(v, torch.fx.Node)}
        others = {_base(v) for i, v in enumerate(values) if i not in weights and isinstance(v, torch.fx.Node)}
        for n in returned_bases & made.keys():
            if n in grads and n not in others:
                apart.add(n)
            else:
                made[n] = 0
    if fused:  # NOTE: [Fused transients]: what Inductor inlines into the kernels that read it
        for n in list(made):
            rs = list(readers(n))
            if _pointwise(n) and n not in returned_bases and rs and all(map(_inlinable, rs)) and (
                    len(rs) == 1 or len(_kernel_inputs(n, made)) <= REALIZE_READS):
                del made[n]
    at = _joined(nodes, made) if fused else pos  # where each made result's kernel runs
    # where each node's work runs: its kernel's position if its result is made, else its reader's
    runs = {}
    for n in reversed(nodes):
        if n in made or n.op != "call_function" or _is_view(n):
            runs[n] = at[n]
        else:
            runs[n] = max((runs[u] for u in readers(n)), default=pos[n])
    end = len(nodes)
    kept = {places[i] for i in held}
    last = {n: end if n in returned_bases or n in kept else
            max((runs[u] for u in readers(n)), default=at[n]) for n in list(inputs) + list(made)}
    if fused:  # a kernel writes into a buffer of its size that dies as it runs
        given = {places[i] for i in donated} & inputs.keys()

        def size(b):  # a buffer the kernel may write into, or None
            return made[b] if b in made else inputs[b] if b in given else None

        def kernels(r):  # the made results whose kernels compute r
            return {r} if r in made or r.op != "call_function" else {k for u in readers(r) for k in kernels(u)}

        def alone(b, n):  # n's kernel reads b, and no kernel joined with it does
            return all(kernels(r) == {n} for r in readers(b))
        for n in sorted(made, key=at.get):
            if not _pointwise(n) or not made[n]:
                continue
            reused = next((b for b in _kernel_inputs(n, made) if last.get(b) == at[n]
                           and size(b) == made[n] and b is not n and alone(b, n)), None)
            if reused is not None:
                last[reused], made[n] = last[n], 0
    inside: dict[int, int] = {}  # bytes inside the kernels at each position: NOTE: [Workspace the trace cannot see]
    for n in made:
        inside[at[n]] = inside.get(at[n], 0) + _kernel_workspace(n)
    frees: dict[int, int] = {}
    live = 0
    for n, nbytes in inputs.items():
        live += nbytes
        frees[last[n]] = frees.get(last[n], 0) + nbytes
    peak = live
    # fused, a weight's gradient is counted from the first position its kernel could run at, the one
    # after its inputs are made: the compiler may run it before the graph's order does (NOTE: [Weight
    # gradients at the backward's peak] in backward.py)
    early = {n: min(at[n], max((at[b] + 1 for b in _kernel_inputs(n, made) if b in made), default=0))
             for n in apart} if fused else {}
    starts: dict[int, int] = {}
    for n, nbytes in made.items():
        first = early.get(n, at[n])
        starts[first] = starts.get(first, 0) + nbytes
        frees[last[n]] = frees.get(last[n], 0) + nbytes
    for i in range(end + 1):
        live += starts.get(i, 0)
        peak = max(peak, live + inside.get(i, 0))
        live -= frees.get(i, 0)
    return peak - sum(made[n] for n in apart)


def _kernel_workspace(node: torch.fx.Node) -> int:
    """Bytes a CUDA kernel holds inside one operator, which the trace's operators (the CPU's, on
    fake tensors) neither make nor show (NOTE: [Workspace the trace cannot see]): attention's
    backward keeps its queries' gradient in fp32 and, where the key and value have fewer heads than
    the queries, makes their gradients at the queries' heads, as the plan's own count does
    (`BACKWARD_RULES` in memory.py)."""
    name = getattr(getattr(node.target, "overloadpacket", None), "__name__", "")
    if not (name.startswith("_scaled_dot_product") and name.endswith("_backward")):
        return 0
    q, k, v = (a.meta.get("val") for a in node.args[1:4])
    if not all(isinstance(t, torch.Tensor) and t.dim() == 4 for t in (q, k, v)):
        return 0
    expanded = 0 if k.shape[1] == q.shape[1] else \
        gqa_gradients_bytes(q.shape[1], k.shape[1], (k.numel() + v.numel()) * k.element_size())
    return dq_accumulator_bytes(q.numel()) + expanded


def _joined(nodes: list, made: dict) -> dict:
    """Where each node runs once Inductor joins element-wise kernels into one: a made element-wise
    result over as many elements as an earlier such kernel, reading a buffer it reads, whose inputs
    are all made before that kernel runs, runs with it (NOTE: [Fused transients])."""
    at = {n: i for i, n in enumerate(nodes)}
    kernels: list[tuple[int, int, set]] = []  # the element-wise kernels so far: where, how many elements, what they read
    for n in nodes:
        if n not in made or not _pointwise(n) or not isinstance(val := n.meta.get("val"), torch.Tensor):
            continue
        reads = set(_kernel_inputs(n, made))
        ready = max((at[b] for b in reads if b in made), default=-1)
        at[n] = next((i for i, numel, read in kernels if i > ready and numel == val.numel() and read & reads), at[n])
        kernels.append((at[n], val.numel(), reads))
    return at


def _kernel_inputs(n: torch.fx.Node, made: dict) -> list:
    """The buffers the kernel computing `n` reads: its inputs' bases, through the element-wise
    producers fused into it."""
    out, todo, seen = [], list(n.all_input_nodes), set()
    while todo:
        m = todo.pop()
        if m in seen:
            continue
        seen.add(m)
        m = _base(m)
        if m.op == "call_function" and m not in made:
            todo.extend(m.all_input_nodes)
        else:
            out.append(m)
    return out


@dataclass(frozen=True)
class HeldFewer:
    """Bytes a fusable stage's compiled body holds fewer than its eager body, at the peaks the plan
    counts (`Stage.peak_bytes`, `saving_peak_bytes`, `backward_bytes`)."""
    forward: int  # a forward without autograd
    saving: int  # a forward keeping what backward reads
    backward: int  # its backward, with what the forward saved
    recompute: int | None  # its recompute and backward at B(s), where it skips work (None: `backward`)
    # the compiled body's own peaks, which a fused stage's never goes under (NOTE: [Workspace the
    # trace cannot see]): its backward with what its forward saved, and its recompute and backward
    backward_peak: int
    recompute_peak: int | None


def fewer(t: Traced, remat: Traced | None = None) -> HeldFewer:
    """Eager's graphs replayed unfused against the compiled ones fused (NOTE: [Fused transients]):
    a backward from what the forward saved, freed at each value's last reader in eager (autograd
    releases a node's saved values once it ran) and compiled (AOTAutograd donates them to the
    compiled backward); as the plan counts a backward (NOTE: [Backward memory] in backward.py),
    without the gradients of the stage's outputs and inputs, its weights' counted as made and taken
    off after (NOTE: [Weight gradients at the backward's peak] in backward.py). `remat`: the body traced as
    its recompute runs it, which saves less and does more in backward."""
    (fe, be), (fc, bc) = t.saving, t.compiled
    eager_backward = peak_bytes(be, False, saved_inputs(fe, t.outputs), returned=False, weights=t.weights)
    compiled_backward = _compiled_backward(fc, bc, t.outputs, t.weights)
    remat_peak = None if remat is None else max(peak_bytes(remat.compiled[0], True),
                                                _compiled_backward(*remat.compiled, remat.outputs, remat.weights))
    return HeldFewer(
        forward=max(0, peak_bytes(fe, False, outputs=t.outputs) - peak_bytes(fe, True, outputs=t.outputs)),
        saving=max(0, peak_bytes(fe, False) - peak_bytes(fc, True)),
        backward=max(0, eager_backward - compiled_backward),
        recompute=None if remat is None else max(0, eager_backward - remat_peak),
        backward_peak=compiled_backward, recompute_peak=remat_peak)


def _compiled_backward(forward: torch.fx.Graph, backward: torch.fx.Graph, outputs: int,
                       weights: frozenset[int] = frozenset()) -> int:
    """A compiled backward's peak: what its forward saved, donated, freed at its last reader and
    written into; neither the output gradients nor the gradients it returns, but its weights' as
    made, taken off after (NOTE: [Weight gradients at the backward's peak] in backward.py)."""
    return peak_bytes(backward, True, saved_inputs(forward, outputs), donated=donated_inputs(forward, outputs),
                      returned=False, weights=weights)
