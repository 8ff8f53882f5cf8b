"""Sharded host weights: each rank's host keeps 1/N of every streamed stage's compute-dtype weights.
`hold` cuts them at bind; `ModelWeights`, a part of the `Trainer`, gives the model's own parameters
the whole weights when something reads them.

NOTE: [Sharded host weights]
With sharded state (NOTE: [Sharded state] in sharding.py) each rank steps only its piece of every
parameter, yet it kept the whole compute-dtype weights of every streamed stage in host memory, the
copy its prefetches read: for the Qwen2.5-72B shape on the 2-GPU H200 box, 135.4 GiB of bf16 weights
per rank against its 117.2 GiB half of the host, so that plan was refused. A schedule with
`SHARDED_WEIGHTS = True` (the default with sharded state; `--whole-host-weights` turns it off) keeps
on each rank only its piece, page-locked: the same `ShardLayout` cut as its state (whole
`QUANT_BLOCK`s with 8-bit states), 67.7 GiB of that 72B's 135.4 at N = 2.
  - every PREFETCH of a streamed stage, forward and backward, copies this rank's piece over PCIe into
    its place in the stage's weight slot, and a GATHER on the COMM stream all-gathers the other
    ranks' pieces into the rest. PCIe carries a piece where it carried the whole weights; the link
    carries the stage's weights once more, at its backward prefetch (the plan counts it in that
    window, solver/step_model.py `_sharded`); the forward's gathered weights no longer go back to
    the host (no OFFLOAD of `w:S`).
  - the optimizer steps the rank's piece where it did; the host piece is then its new weights: a
    host step writes it in place (the piece is the home where the dtypes agree) or through
    `refresh_source` (mixed precision), a GPU step copies back its piece of the slot.
  - the model's own parameters of streamed stages hold no storage between steps: a placeholder of
    their shape and dtype (one element, expanded; it reads as zeros). `sync_model()`, which the
    model's `state_dict()` and forward call (NOTE: [Model sync hooks] in model_sync.py), gathers the
    whole weights into them, in host memory the plan does not count, and the next step lets them go
    again. Checkpoint with `sharded_state_dict()`, which holds only the pieces (resumable at any
    number of ranks through the masters, NOTE: [Sharded checkpoints] in sharded_state.py).
The bind-time check that the ranks start from the same weights (`DataParallel.check_agree`) samples
the other parameters only: the ranks' pieces differ by design.
"""

from __future__ import annotations

import torch


def placeholder(t: torch.Tensor) -> torch.Tensor:
    """A tensor of `t`'s shape, dtype and device without its storage: one element, expanded."""
    return torch.zeros((), dtype=t.dtype, device=t.device).expand(t.shape)


def hold(module, tensors: dict[str, torch.Tensor], layouts: dict, pinned) -> dict[str, torch.Tensor]:
    """This rank's pieces of the streamed stages' weights in the compute dtype, page-locked copies of
    their own (`pinned`: the trainer's arena), one tensor at a time; the model's parameters keep
    placeholders (NOTE: [Sharded host weights])."""
    held = {}
    for s in module.STAGES:
        if not s.placement.streamed:
            continue
        for p in s.params:
            t = tensors[p]
            held[p] = pinned.copy_of(layouts[s.index].own(p, t.detach()).to(getattr(torch, module.PLACEHOLDERS[p][3])))
            t.data = placeholder(t)
    return held


class ModelWeights:
    """The model's parameters of the streamed stages under sharded host weights: placeholders between
    steps, the whole weights from a `land` until the next `drop`."""

    def __init__(self, module, tensors: dict[str, torch.Tensor], held: dict[str, torch.Tensor]):
        self.params = {p: tensors[p] for p in held}
        self.stages = {s.index: s.params for s in module.STAGES if s.placement.streamed and s.params}
        self.landed = False

    def land(self, store, fetch, gather, release) -> None:
        """Each stage's weights gathered through its weight slot (`fetch`, `gather`, `release`: the
        trainer's) into the model's parameters. A collective: every rank calls it."""
        if self.landed:
            return
        with torch.no_grad():
            for s, names in self.stages.items():
                fetch(s)
                gather(s)
                for p in names:
                    t = self.params[p]
                    t.data = store.work[p].detach().to(t.device, t.dtype, copy=True)
                release(s)
        self.landed = True

    def drop(self) -> None:
        """The model's whole weights go again (a step changes them)."""
        if self.landed:
            for t in self.params.values():
                t.data = placeholder(t)
            self.landed = False
