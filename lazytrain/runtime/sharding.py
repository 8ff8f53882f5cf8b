"""Sharded data-parallel state: each rank keeps 1/N of the master weights and optimizer states.
`ShardLayout` cuts a stage's parameters; `Sharding`, a part of the `Trainer`, runs the REDUCE and
GATHER events.

NOTE: [Sharded state]
A schedule compiled with `--world-size N` (N > 1) and `SHARDED = True` (the default) runs ZeRO-2
style. Every parameter is cut along its flattened elements into N pieces of c = ceil(numel / N)
elements, rank r owning [r*c, min((r+1)*c, numel)) (torch.chunk's cut, the last pieces shorter or
empty: the cut of a `Shard(0)` DTensor, so checkpoints reshard). With 8-bit states (bitsandbytes'
blockwise AdamW8bit, which quantises each block of `QUANT_BLOCK` = 256 elements with its own absmax)
c is rounded up to whole blocks, c = ceil(ceil(numel / N) / 256) * 256: every block lies on one rank,
so quantising a piece is quantising that part of the whole tensor, and the whole tensor's last,
shorter block is the last piece's. bitsandbytes keeps 32-bit states below `min_8bit_size` (4096)
elements, judged here by the whole parameter, not the piece (optim8bit.py). So sharded 8-bit states
step every weight bit for bit as replicated ones (the whole tensor on every rank, as one process)
on the same averaged gradients (tests/test_data_parallel_8bit.py). The cost: a rank's piece may be
up to a block per parameter longer than its 1/N (the plan counts it, solver/shards.py), and the
ranks past a small parameter's last block hold none of it (a bias of 32 elements: rank 0 alone).
Distributed checkpoints do not hold this cut yet (NOTE: [Sharded checkpoints] in sharded_state.py).
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
    prefetch reads; with sharded host weights every prefetch brings the piece and gathers, and
    nothing goes back (NOTE: [Sharded host weights] in host_weights.py).
Gradient clipping adds each rank's squared norm of its shards and all-reduces the sum: the global
norm, as one process would clip. AdamW is elementwise, so stepping pieces equals stepping the whole
tensors; bf16 masters draw their rounding noise by each element's index in its whole parameter
(NOTE: [bf16 master weights] in optim.py), so weights do not depend on the number of ranks. Every
rank then holds the same weights, those of single-process AdamW on the global batch.
`forward_backward` (no step) all-reduces instead, leaving the full averaged gradients in `.grad`.
Updates still to gather (streamed stages, whose gather waits for their next forward) are gathered
by `synchronize()`, so `synchronize`, `sync_model`, `state_dict` and the model's own `state_dict()`
and forward after a step are collectives: call them on every rank.
"""

from __future__ import annotations

import math

import torch

from lazytrain.ir.events import Event, Stream


class ShardLayout:
    """The cut of one stage's parameters (names -> numel) over `world` ranks, seen from `rank`: pieces
    of whole `align`-element blocks (1: torch.chunk's cut; `QUANT_BLOCK` with 8-bit states)."""

    def __init__(self, numels: dict[str, int], world: int, rank: int, align: int = 1):
        self.world, self.rank, self.align = world, rank, align
        self.numel = dict(numels)
        self.chunk = {p: math.ceil(math.ceil(n / world) / align) * align for p, n in numels.items()}
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


class Sharding:
    """Sharded state as the schedule runs: its REDUCE and GATHER events, and the stages stepped whose
    new weights are still to gather. A `Trainer` has one only with sharded state."""

    def __init__(self, stages, groups, store, dp, streams, gradients, gpu_stepped: frozenset[int], device: torch.device):
        self.stages, self.groups, self.store, self.dp, self.streams = stages, groups, store, dp, streams
        self.gradients = gradients
        self.gpu_stepped = gpu_stepped  # streamed stages stepped on the device: their step writes the host copy
        self.device = device
        self.cuda = device.type == "cuda"
        self.scattering = False  # this step reduce-scatters (`forward_backward`'s backward all-reduces instead)
        self._pending: set[int] = set()  # stages stepped whose new weights are not yet gathered
        self._gathered: set[int] = set()  # streamed stages gathered at this prefetch: their weights go back to the host
        # NOTE: [Sharded host weights] in host_weights.py: streamed stages gathered at every prefetch
        self.always = frozenset(s.index for s in stages if s.placement.streamed and any(p in store.held for p in s.params))

    def begin(self, optimize: bool) -> None:
        self.scattering = optimize

    def updated(self, s: int) -> None:
        """This rank's piece of stage `s` (-1: the shared weights) changed: its GATHER, or `synchronize`,
        brings the other ranks' pieces (not to wait for where every prefetch gathers)."""
        if s not in self.always:
            self._pending.add(s)

    def gathers_always(self, s: int) -> bool:
        """Every prefetch of stage `s` gathers its weights (NOTE: [Sharded host weights] in host_weights.py)."""
        return s in self.always

    def awaits(self, s: int) -> bool:
        """Stage `s`'s new weights are still to gather: a prefetch brings this rank's piece alone."""
        return s in self._pending or s in self.always

    def awaiting(self) -> list[int]:
        return sorted(self._pending)

    def reduce(self, e: Event) -> None:
        """This rank's shard of the stage's averaged gradients; the full ones go (NOTE: [Sharded
        state]). Without a step (`forward_backward`) the backward all-reduced them."""
        if not self.scattering:
            return
        s, work = e.stage, self.store.work
        names = self.groups.names(s)
        full = {p: work[p].grad if work[p].grad is not None else
                torch.zeros(self.store.master[p].shape, dtype=self.store.dtype[p], device=self.device) for p in names}
        shards = self.dp.reduce_scatter(s, self.store.layouts[s], full)
        for p in names:
            if work[p].grad is None:  # no gradient on any rank (the same graph): not stepped, as torch skips it
                shards[p] = None
            elif self.cuda:  # the compute stream may reuse it once the collective has read it
                work[p].grad.record_stream(torch.cuda.current_stream())
            work[p].grad = None
        if s >= 0 and self.stages[s].placement.streamed:  # the shard goes to the host (OFFLOAD sg:S)
            self.gradients.parked[s] = shards
            if self.cuda:  # made on the comm stream's pool, read by the copy: not reused before it is done
                for g in shards.values():
                    if g is not None:
                        g.record_stream(self.streams.stream(Stream.D2H))
        else:
            for p, g in shards.items():
                home = self.store.home[p]
                home.grad = None if g is None else g if g.dtype == home.dtype else g.to(home.dtype)
        if self.gradients.clipped:
            self.gradients.add_norm([g for g in shards.values() if g is not None])

    def gather(self, e: Event) -> None:
        """A stepped stage's new weights from every rank's piece (NOTE: [Sharded state])."""
        if not self.awaits(e.stage):
            return
        self.gather_stage(e.stage)
        if e.stage >= 0 and self.stages[e.stage].placement.streamed and e.stage not in self.gpu_stepped | self.always:
            self._gathered.add(e.stage)  # its OFFLOAD w:S takes them to the host
        self.streams.stepped_at(e.stage)  # the next compute that reads them waits for this

    def gather_stage(self, s: int) -> None:
        self._pending.discard(s)
        targets = {p: self.store.work[p].data for p in self.groups.names(s)}
        pieces = {p: self.store.mine(p, t) for p, t in targets.items()}
        self.dp.all_gather(s, self.store.layouts[s], pieces, targets)

    def holds_gathered(self, s: int) -> bool:
        """Host-stepped streamed stage `s` was gathered at this prefetch: its OFFLOAD w:S writes them."""
        return s in self._gathered

    def write_gathered(self, s: int) -> None:
        """A host-stepped streamed stage's gathered weights to the host copy prefetches read."""
        self._gathered.discard(s)
        for p in self.stages[s].params:
            self.store.source[p].copy_(self.store.work[p].data, non_blocking=True)
