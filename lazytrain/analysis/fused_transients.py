"""What a stage's compiled body holds in flight, against its eager body (NOTE: [Fused transients]).

    model.layers.4 (Qwen2.5-7B shape, 32 x 1024, bf16): compiled, a forward without autograd
    peaks 0.94 GiB lower (2.75 GiB), a saving forward 2.47 GiB lower (5.44, with the partitioner's
    saved bytes), its backward 1.40 GiB lower (8.16)

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
partitioned twice): eager's with every operator's result made, the compiled ones with the results
Inductor fuses away left out and in-place writes taken; the stage's peaks lose the difference. A
forward without autograd is the eager partition's forward keeping only the stage's outputs. A result is fused away when it is
element-wise (`torch.Tag.pointwise`), not returned, and its one reader (through views) is
element-wise too; its inputs then live until that reader runs. Inductor fuses more (into
reductions; values read twice), so the replay gives what it saves at least. A backward is replayed
from its inputs (what the forward saved, and the output gradients): eager's from the partition that
saves what the forward made (`default_partition`), freeing each at its last reader as autograd's
nodes release theirs (this replay of a 7B layer gives 9.63 GiB, the plan's own count 9.57); the
compiled one from the min-cut partition, holding them to its end, as its one autograd node does
(freed at their last readers it would peak at 7.07 GiB, under the 7.64 the device implies).
With it the same decisions of the six fused 24 GiB rows predict their peaks 0.9-3.4 % over the
allocated peak (5.3-5.8 % for the 7B before), and the max-budget rows of 0d235c1 1.4 % (7B) and
0.5 % (1.5B), all on the safe side.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch

from lazytrain.analysis.fused_saved import Traced, backward_inputs


def _is_view(node: torch.fx.Node) -> bool:
    t = node.target
    return t is operator.getitem or getattr(t, "is_view", False) or t is torch.ops.aten._unsafe_view.default


def _base(node: torch.fx.Node) -> torch.fx.Node:
    """The node whose memory `node` is: through views and tuple items to the operator that made it."""
    while node.op == "call_function" and _is_view(node) and node.args and isinstance(node.args[0], torch.fx.Node):
        node = node.args[0]
    return node


def _pointwise(node: torch.fx.Node) -> bool:
    return node.op == "call_function" and torch.Tag.pointwise in getattr(node.target, "tags", ())


def _nbytes(node: torch.fx.Node) -> int:
    val = node.meta.get("val")
    vals = val if isinstance(val, (tuple, list)) else (val,)
    return sum(v.untyped_storage().nbytes() for v in vals if isinstance(v, torch.Tensor))


def peak_bytes(graph: torch.fx.Graph, fused: bool, counted_inputs: frozenset[int] = frozenset(),
               held: bool = False, outputs: int | None = None) -> int:
    """The most bytes `graph`'s values hold at once when its nodes run in order: every operator's
    result (a view is its base's), freed after its last reader; what it returns, to its end. Its
    inputs are left out but for the positions in `counted_inputs`, from its start to their last
    reader, or with `held` to its end. `fused`: the results Inductor fuses away are never made, and
    a kernel writes into a buffer of its size that dies as it runs (NOTE: [Fused transients]).
    `outputs`: only the first this many returned values are kept (a partitioned forward run without
    autograd, whose values saved for backward die at their last reader)."""
    nodes = list(graph.nodes)
    pos = {n: i for i, n in enumerate(nodes)}
    out = next(n for n in nodes if n.op == "output")
    returned: set = set()
    torch.fx.node.map_arg(out.args[0][:outputs] if outputs is not None else out.args, returned.add)

    def readers(n):  # the nodes that read n's memory, through views (what is returned is held apart)
        for u in n.users:
            if u.op == "call_function" and _is_view(u):
                yield from readers(u)
            elif u.op != "output":
                yield u

    places = [n for n in nodes if n.op == "placeholder"]
    inputs = {n: _nbytes(n) for i, n in enumerate(places) if i in counted_inputs}
    made = {n: _nbytes(n) for n in nodes if n.op == "call_function" and not _is_view(n)}
    returned_bases = {_base(n) for n in returned}
    if fused:
        for n in list(made):
            rs = list(readers(n))
            if _pointwise(n) and n not in returned_bases and len(rs) == 1 and _pointwise(rs[0]):
                del made[n]
    # where each node's work runs: its own position if its result is made, else its reader's
    runs = {}
    for n in reversed(nodes):
        if n in made or n.op != "call_function" or _is_view(n):
            runs[n] = pos[n]
        else:
            runs[n] = max((runs[u] for u in readers(n)), default=pos[n])
    end = len(nodes)
    last = {n: end if n in returned_bases or (held and n in inputs) else
            max((runs[u] for u in readers(n)), default=pos[n]) for n in list(inputs) + list(made)}
    if fused:  # a kernel writes into a buffer of its size that dies as it runs
        for n in sorted(made, key=pos.get):
            if not _pointwise(n):
                continue
            reused = next((b for b in _kernel_inputs(n, made) if b in made and last[b] == pos[n]
                           and made[b] == made[n] and b is not n), None)
            if reused is not None:
                last[reused], made[n] = last[n], 0
    frees: dict[int, int] = {}
    live = 0
    for n, nbytes in inputs.items():
        live += nbytes
        frees[last[n]] = frees.get(last[n], 0) + nbytes
    peak = live
    starts: dict[int, int] = {}
    for n, nbytes in made.items():
        starts[pos[n]] = starts.get(pos[n], 0) + nbytes
        frees[last[n]] = frees.get(last[n], 0) + nbytes
    for i in range(end + 1):
        live += starts.get(i, 0)
        peak = max(peak, live)
        live -= frees.get(i, 0)
    return peak


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


def fewer(t: Traced) -> HeldFewer:
    """Eager's graphs replayed unfused against the compiled ones fused (NOTE: [Fused transients]):
    a backward from what the forward saved, freed at each value's last reader in eager (autograd
    releases a node's saved values once it ran) and held to the end compiled (one autograd node
    holds them all until it returns)."""
    (fe, be), (fc, bc) = t.saving, t.compiled
    return HeldFewer(
        forward=max(0, peak_bytes(fe, False, outputs=t.outputs) - peak_bytes(fe, True, outputs=t.outputs)),
        saving=max(0, peak_bytes(fe, False) - peak_bytes(fc, True)),
        backward=max(0, peak_bytes(be, False, backward_inputs(fe, be, t.outputs))
                     - peak_bytes(bc, True, backward_inputs(fc, bc, t.outputs), held=True)))
