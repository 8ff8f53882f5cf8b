"""Sharded data-parallel state: each rank keeps 1/N of the master weights and optimizer states.

NOTE: [Sharded state]
A schedule compiled with `--world-size N` (N > 1) and `SHARDED = True` (the default with 32-bit
optimizer states) runs ZeRO-2 style. Every parameter is cut along its flattened elements into N
pieces of c = ceil(numel / N) elements, rank r owning [r*c, min((r+1)*c, numel)) (torch.chunk's
cut, the last pieces shorter or empty: the cut of a `Shard(0)` DTensor, so checkpoints reshard).
Per stage (and for the shared parameters, after stage 0):
  - REDUCE (comm stream, during the next stage's backward): the stage's full gradients are packed
    into a flat buffer of N equal regions (region r: every parameter's piece r, padded to c) and
    reduce-scattered, then divided by N: each rank holds the average of its pieces only, and the
    full gradients go. A streamed stage's shard is what goes to the host.
  - the optimizer steps only the rank's pieces, where the plan puts the stage's step (resident and
    shared: the GPU; streamed: the host, or the GPU at the next prefetch). Its masters are those
    pieces: a view of the rank's piece of the full weights where the master dtype is the compute
    dtype, else (mixed precision) a tensor of the piece alone; so in mixed precision the model's own
    parameters become the full weights in the compute dtype (the masters are the ranks' shards).
  - GATHER (comm stream): the rank's updated pieces in the compute dtype are all-gathered from the
    same flat layout into the full weights: a resident stage's right after its step; a streamed
    stage's at its next forward prefetch, which brings only the rank's piece from the host (or, GPU-
    stepped, steps it there) and sends the gathered weights back to the host copy the backward
    prefetch reads.
Gradient clipping adds each rank's squared norm of its shards and all-reduces the sum: the global
norm, as one process would clip. AdamW is elementwise, so stepping pieces equals stepping the whole
tensors; bf16 masters draw their rounding noise by each element's index in its whole parameter
(NOTE: [bf16 master weights] in optim.py), so weights do not depend on the number of ranks. Every
rank then holds the same weights, those of single-process AdamW on the global batch.
8-bit states (bitsandbytes) are quantised in blocks along whole tensors: they are not sharded (the
compiler refuses it; such schedules replicate, NOTE: [Data parallel] in data_parallel.py).
`forward_backward` (no step) all-reduces instead, leaving the full averaged gradients in `.grad`.
Updates still to gather (streamed stages, whose gather waits for their next forward) are gathered
by `synchronize()`, so `synchronize`, `sync_model`, `state_dict` and the model's own `state_dict()`
and forward after a step are collectives: call them on every rank.
"""

from __future__ import annotations

import math

import torch


class ShardLayout:
    """The cut of one stage's parameters (names -> numel) over `world` ranks, seen from `rank`."""

    def __init__(self, numels: dict[str, int], world: int, rank: int):
        self.world, self.rank = world, rank
        self.numel = dict(numels)
        self.chunk = {p: math.ceil(n / world) for p, n in numels.items()}
        self.offset: dict[str, int] = {}
        off = 0
        for p, c in self.chunk.items():
            self.offset[p] = off
            off += c
        self.region = off  # elements of one rank's region of the flat buffer

    def span(self, p: str, rank: int | None = None) -> tuple[int, int]:
        """The elements of `p` that `rank` (default: this one) owns."""
        r = self.rank if rank is None else rank
        c, n = self.chunk[p], self.numel[p]
        return min(n, r * c), min(n, (r + 1) * c)

    def own(self, p: str, full: torch.Tensor) -> torch.Tensor:
        """This rank's piece of `full` (a whole parameter, or its gradient), a flat view."""
        lo, hi = self.span(p)
        return full.view(-1)[lo:hi]

    def pack(self, tensors: dict[str, torch.Tensor], out: torch.Tensor) -> torch.Tensor:
        """Every rank's pieces of the full `tensors` into the flat buffer `out` (world * region)."""
        rows = out.view(self.world, self.region)
        for p, t in tensors.items():
            off, c = self.offset[p], self.chunk[p]
            if self._full_rows(p) < self.world:  # the padding of the short and empty pieces
                rows[self._full_rows(p):, off:off + c].zero_()
            for region, part in self._parts(p, rows, t.reshape(-1)):
                region.copy_(part)
        return out

    def unpack(self, flat: torch.Tensor, targets: dict[str, torch.Tensor]) -> None:
        """Every rank's pieces in the flat buffer into the full `targets`."""
        rows = flat.view(self.world, self.region)
        for p, t in targets.items():
            for region, part in self._parts(p, rows, t.view(-1)):
                part.copy_(region)

    def _full_rows(self, p: str) -> int:
        """The ranks whose piece of `p` is a whole chunk (the first ones)."""
        c = self.chunk[p]
        return self.numel[p] // c if c else 0

    def _parts(self, p: str, rows: torch.Tensor, flat: torch.Tensor):
        """(part of the flat buffer's `rows`, part of `p`'s flattened elements `flat`) pairs holding
        the same elements: the whole chunks, then the one shorter piece."""
        off, c, full = self.offset[p], self.chunk[p], self._full_rows(p)
        if full:
            yield rows[:full, off:off + c], flat[:full * c].view(full, c)
        rest = self.numel[p] - full * c
        if rest:
            yield rows[full, off:off + rest], flat[full * c:]

    def region_of(self, flat: torch.Tensor, p: str) -> torch.Tensor:
        """This rank's piece of `p` inside its own region `flat` (region elements)."""
        lo, hi = self.span(p)
        return flat[self.offset[p]:self.offset[p] + hi - lo]
