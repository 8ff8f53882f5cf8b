"""Gradients on their way from backward to the optimizer, in one object the `Trainer` owns and hands
to the parts that make them (the event handlers in replay.py, the REDUCE events in sharding.py) and
to those that take them (stepping.py and the step kinds in steps.py): streamed stages' gradients
parked on the device until their offload, their page-locked host buffers, the squared norm they add
up to, and the device steps issued, whose gradients may then go."""

from __future__ import annotations

import torch

from lazytrain.runtime.groups import Groups
from lazytrain.runtime.pinned import PinnedArena
from lazytrain.runtime.store import ParamStore


class Gradients:
    def __init__(self, stages, groups: Groups, store: ParamStore, pinned: PinnedArena, clipped: bool):
        self.stages, self.groups, self.store, self.pinned = stages, groups, store, pinned
        self.clipped = clipped  # the step clips (`max_grad_norm`): backward adds up the squared norm
        # NOTE: [Resident gradients freed at their step] in solver/footprint.py
        self.freed = frozenset(s.index for s in stages if s.placement.step.frees_grads)
        self.host: dict[str, torch.Tensor] = {}  # page-locked, in the compute dtype (D2H target)
        self.fresh: set[str] = set()  # parameters whose host buffer holds a gradient not yet absorbed
        self._buffers: dict[str, torch.Tensor] = {}  # gradients of host-stepped parameters, in the master's dtype
        # the running step's (`begin`):
        self.parked: dict[int, dict[str, torch.Tensor | None]] | None = None  # streamed stage -> gradients (g:S, sg:S)
        self.norm_sq: torch.Tensor | None = None  # the squared norm of the gradients added so far
        self.issued: set[int] = set()  # stages whose device step was issued

    def begin(self) -> None:
        self.parked = {}
        self.norm_sq = None
        self.issued = set()

    def end(self) -> None:
        self.parked = None

    def add_norm(self, grads) -> None:
        if grads:
            sq = torch.stack(torch._foreach_norm(grads)).float().pow(2).sum()
            self.norm_sq = sq if self.norm_sq is None else self.norm_sq + sq

    def offload(self, stage: int) -> None:
        """A streamed stage's parked gradients (sharded: this rank's shard) into their host buffers."""
        for name, g in self.parked[stage].items():
            if g is None:
                continue
            host = self.host.get(name)
            if host is None or host.shape != g.shape:
                host = self.host[name] = self.pinned.empty(g.shape, g.dtype)
            host.copy_(g, non_blocking=True)
            self.fresh.add(name)

    def absorb(self, stage: int) -> None:
        """Before stage `stage`'s step (-1: the shared weights'): its gradients held elsewhere (host
        buffers, device work copies) into its homes' `.grad`."""
        self._absorb([stage], into_model=False)

    def absorb_all(self) -> None:
        """Without a step (`forward_backward`): every gradient into the model's own `.grad`, added to
        what it held."""
        self._absorb(self.groups.order, into_model=True)

    def _absorb(self, stages, into_model: bool) -> None:
        store = self.store
        for s in stages:
            for p in self.groups.names(s):
                streamed = s >= 0 and self.stages[s].placement.streamed
                if streamed:  # page-locked buffers stay (allocating them is slow); the mark is consumed
                    src = self.host[p] if p in self.fresh else None
                    self.fresh.discard(p)
                else:
                    src = store.work[p].grad
                target = store.master[p] if into_model else store.home[p]
                if src is None or (not streamed and target is store.work[p]):
                    continue
                if target.grad is None and streamed and not into_model:  # a step: reuse a buffer
                    buf = self._buffers.get(p)
                    if buf is None:
                        buf = self._buffers[p] = torch.empty(src.shape, dtype=target.dtype, device=target.device)
                    target.grad = buf.copy_(src)
                    continue
                g = src.to(target.device, target.dtype, copy=True)
                target.grad = g if target.grad is None else target.grad + g
                if not streamed:
                    store.work[p].grad = None

    def discard(self, stages) -> None:
        """This step's gradients go unread (`Trainer.loss`): the host buffers' marks, and every `.grad`."""
        self.fresh.clear()
        self.clear(stages)

    def clear(self, stages) -> None:
        """Every gradient of these stages' parameters (-1: the shared ones) goes."""
        for s in stages:
            for p in self.groups.names(s):
                self.store.master[p].grad = None
                self.store.home[p].grad = None
                self.store.work[p].grad = None

    def free_issued(self, names) -> None:
        """NOTE: [Resident gradients freed at their step] in solver/footprint.py: the gradients of a
        stage whose step has been issued go now; the optimizer stream that reads them recorded its
        use, so their memory is reused only once the step is done."""
        for name in names:
            idx = name.partition(":")[2]
            if idx.isdigit() and int(idx) in self.freed and int(idx) in self.issued:
                self.clear([int(idx)])
