"""Replaying a schedule's events: forward, backward, recompute, prefetch, offload, reload, free.

`Replay` is the `Trainer`'s event loop and handlers: each touches only the buffers its event names,
so a wrong schedule fails loudly instead of computing something else. OPT_STEP events go to the
optimizer side (stepping.py), REDUCE and GATHER to sharding.py, a chunked loss stage to chunked.py.

NOTE: [Streamed weights]
A streamed stage's parameters are persistent leaf tensors whose storage comes and goes: PREFETCH
points `leaf.data` at a weight slot and copies the weights in, FREE swaps in an empty tensor.
Autograd saved the leaf itself during forward, so backward (after the next PREFETCH) sees the same
leaf with its data back, and gradients accumulate on it, whatever the stage's recompute mode.
Swapping `.data` does not bump the version counter, so autograd accepts it.
"""

from __future__ import annotations

import contextlib
import math

import torch

from lazytrain.ir.events import Event, Kind, Phase
from lazytrain.ir.placement import Outputs, Split
from lazytrain.runtime import rng
from lazytrain.runtime.chunked import chunked_backward
from lazytrain.runtime.gpu_step import GpuStepper
from lazytrain.runtime.gradients import Gradients
from lazytrain.runtime.steps import Turn
from lazytrain.runtime.stepping import Stepping
from lazytrain.runtime.store import ParamStore


class Replay:
    """One step's events for a `Trainer`: `begin(batch)`, `run(turn)`, `end()` (the loss). Its own
    state is the step's activations; the weights come from the parameter store (store.py) and the
    slots it fetches them into (`fetch_stage`, `release_weights`, which `Trainer.synchronize` uses
    too); gradients go to `gradients` (gradients.py), the events of the optimizer to `stepping`, and
    those of sharded state to `sharding` (None without it)."""

    def __init__(self, schedule, stages, store: ParamStore, streams, stepper: GpuStepper, gradients: Gradients,
                 stepping: Stepping, sharding, dp, act_disk, ring, pinned, device: torch.device):
        self.m = schedule
        self.stages, self.events = stages, schedule.EVENTS  # the schedule's, or fused (NOTE: [Fused stages])
        self.store, self.streams, self.stepper, self.gradients = store, streams, stepper, gradients
        self.stepping, self.sharding, self.dp = stepping, sharding, dp
        self.act_disk = act_disk  # NOTE: [Activations on disk] in solver/disk_model.py
        self.ring = ring  # the ring stages stepped in backward take their states through, if any
        self.pinned, self.device = pinned, device
        self.cuda = device.type == "cuda"
        self.host_act: dict[str, torch.Tensor] = {}  # page-locked copies of offloaded outputs, kept across steps
        # NOTE: [Boundary tiles] in solver/boundary.py: an output split by the tile, its shape, dtype
        # and elements on the device, the host and disk; and the device's parts while the rest is away
        self.whole: dict[str, tuple] = {}
        self.parts: dict[str, torch.Tensor] = {}
        self.env = self.act_grads = self.saved = self.rng = None
        self.loss = self.loss_scale = None

    def begin(self, batch: dict) -> None:
        """A step over `batch` (on the device, checked)."""
        self.env = dict(batch)  # placeholder/activation name -> tensor
        self.env.update(self.store.buffers)
        self.act_grads: dict[str, torch.Tensor] = {}  # activation name -> its gradient
        self.saved: dict[int, tuple] = {}
        self.rng: dict[int, rng.RngState] = {}  # random stage -> generator states its forward began from
        self.loss = None
        self.parts = {}  # NOTE: [Boundary tiles]: none left by a step that failed halfway
        self.loss_scale = None  # with ranks: world / their learnt targets, once per step (NOTE: [Data parallel])
        if self.act_disk is not None:  # NOTE: [Activations on disk] in solver/disk_model.py
            self.act_disk.begin()

    def run(self, turn: Turn) -> None:
        """The schedule's events, in order, on their streams."""
        handlers = {  # made here: held by the part, its own bound methods would make a reference cycle
            Kind.PREFETCH: self._prefetch, Kind.COMPUTE: self._compute, Kind.OFFLOAD: self._offload,
            Kind.RELOAD: self._reload, Kind.FREE: self._free,
        }
        if self.sharding is not None:  # NOTE: [Sharded state] in sharding.py: only such schedules have these events
            handlers.update({Kind.REDUCE: self.sharding.reduce, Kind.GATHER: self.sharding.gather})
        for event in self.events:
            if event.kind is Kind.OPT_STEP:  # by its stage's kind (steps.py)
                self.stepping.issue(event, turn)
                continue
            if event.kind is Kind.GATHER and turn.defers(event.stage) and not self.sharding.gathers_always(event.stage):
                turn.gathers[event.stage] = event  # after its deferred step
                continue
            if event.kind is Kind.COMPUTE:  # its weights must be stepped (NOTE: [Optimizer stream] in stepping.py)
                self.streams.wait_aside(event.stage)
                self.streams.wait_aside(-1)  # shared (tied) weights
            self.streams.run(event, lambda e=event: handlers[e.kind](e))

    def end(self) -> torch.Tensor:
        """The step's loss, once every stream has finished; on several ranks the global batch's (NOTE:
        [Data parallel] in data_parallel.py). The step's activations go."""
        loss, self.loss = self.loss, None
        if self.dp is not None and loss is not None:
            loss = self.dp.mean_loss(loss)
        self.env = self.act_grads = self.saved = self.rng = None
        self.parts = {}
        return loss

    def _weight(self, name):
        work = self.store.work.get(name)
        return work if work is not None else self.env[name]

    def _call(self, stage, grad: bool, remat: bool = False, again: bool = False):
        """Run a stage's forward. With `grad`, inputs become fresh leaves and autograd records; with
        `remat`, the values no backward reads are left uncomputed (NOTE: [Skipped recompute] in analysis/remat.py); with
        `again` (a recompute), a random stage draws what its forward drew (NOTE: [RNG replay] in rng.py)."""
        draws = contextlib.nullcontext()
        if stage.random and again:
            draws = rng.replay(self.rng[stage.index], self.device)
        elif stage.random:
            self.rng[stage.index] = rng.record(self.device)
        summed = self.dp is not None and stage.loss_sum  # NOTE: [Data parallel] in data_parallel.py
        kw = {"loss_sum": True} if summed else {}
        if grad:
            leaves = {x: self.env[x].detach().requires_grad_(x in stage.grad_inputs) for x in stage.inputs}
            args = [self._weight(p) for p in stage.placeholders] + [leaves[x] for x in stage.inputs]
            with torch.enable_grad(), draws:
                outs = stage.fn(self.device, *args, **kw, **({"remat": True} if remat and stage.skips else {}))
            return leaves, self._ranks_loss(*outs) if summed else outs
        args = [self._weight(p) for p in stage.placeholders] + [self.env[x] for x in stage.inputs]
        with torch.no_grad(), draws:
            outs = stage.fn(self.device, *args, **kw)
        return None, self._ranks_loss(*outs) if summed else outs

    def _ranks_loss(self, loss_sum: torch.Tensor, count: torch.Tensor) -> tuple[torch.Tensor]:
        """A loss stage's (sum, count) on one of several ranks: its loss is the sum times world / the
        ranks' count, whose mean over the ranks is the global batch's mean (NOTE: [Data parallel])."""
        if self.loss_scale is None:
            self.loss_scale = self.dp.loss_scale(count)
        return ((loss_sum.float() * self.loss_scale).to(loss_sum.dtype),)

    def _publish(self, stage, outs):
        for name, t in zip(stage.outputs, outs):
            if name == self.m.LOSS:
                self.loss = t.detach()
            else:
                self.env[name] = t.detach()

    def _compute(self, e: Event):
        stage = self.stages[e.stage]
        if e.phase is Phase.FWD:
            if stage.chunks > 1:  # its loss comes out of its backward (NOTE: [Chunked loss] in chunked.py)
                return
            leaves, outs = self._call(stage, grad=not stage.placement.recomputed)
            if not stage.placement.recomputed:
                self.saved[e.stage] = (leaves, outs)
            self._publish(stage, outs)
        elif e.phase is Phase.RECOMPUTE:
            self._publish(stage, self._call(stage, grad=False, again=True)[1])
        elif stage.chunks > 1:
            self._chunked_backward(stage)
        else:
            self._backward(stage)

    def _backward(self, stage):
        leaves, outs = self.saved.pop(stage.index) if not stage.placement.recomputed else self._call(
            stage, grad=True, remat=True, again=True)
        tensors, grads = [], []
        for name, t in zip(stage.outputs, outs):
            g = torch.ones_like(t) if name == self.m.LOSS else self.act_grads.get(name)
            if g is not None and t.requires_grad:
                tensors.append(t)
                grads.append(g)
        if tensors:
            torch.autograd.backward(tensors, grads)
        for x in stage.grad_inputs:
            g = leaves[x].grad
            if g is not None:
                self.act_grads[x] = g if x not in self.act_grads else self.act_grads[x] + g
        self._grads_done(stage)

    def _chunked_backward(self, stage):
        """A chunked stage's forward and backward (NOTE: [Chunked loss] in chunked.py)."""
        loss, grads = chunked_backward(stage, self.env, self._weight, self.store.work, self.m.PLACEHOLDERS, self.device,
                                       self.dp)
        for x, g in grads.items():
            self.act_grads[x] = g if x not in self.act_grads else self.act_grads[x] + g
        self._publish(stage, (loss,))
        self._grads_done(stage)

    def _grads_done(self, stage):
        """After a stage's backward: average its gradients over data-parallel ranks; park streamed
        gradients for their offload; add to the norm."""
        work = self.store.work
        if self.sharding is not None and self.sharding.scattering:  # its REDUCE event reduce-scatters them
            return  # (NOTE: [Sharded state] in sharding.py)
        if self.dp is not None:  # before anything reads them (NOTE: [Data parallel] in data_parallel.py)
            names = stage.params + (self.m.SHARED if stage.index == 0 else ())
            self.dp.reduce_grads(stage.index, [work[p].grad for p in names if work[p].grad is not None])
        if stage.placement.streamed:  # gradients of streamed weights wait in g:S for their offload
            self.gradients.parked[stage.index] = {p: work[p].grad for p in stage.params}
            for p in stage.params:
                work[p].grad = None
        if self.gradients.clipped:
            names = stage.params + (self.m.SHARED if stage.index == 0 else ())
            parked = self.gradients.parked[stage.index].values() if stage.placement.streamed else ()
            done = [g for g in parked if g is not None]
            done += [work[p].grad for p in names if not stage.placement.streamed or p in self.m.SHARED if work[p].grad is not None]
            self.gradients.add_norm(done)

    def _prefetch(self, e: Event):
        if self.stages[e.stage].placement.weights.cast_on_use:
            self._cast_weights(e.stage)
            return
        self.stepping.wait_host_step(e.stage)  # the previous step's host optimizer must finish updating the source
        self.fetch_stage(e.stage, update=e.allocs[0].startswith("opt:") and e.stage in self.stepper.pending)

    def _cast_weights(self, stage: int):
        """NOTE: [Resident weights cast on use] in solver/footprint.py: on the compute stream, once
        the stage's last step on the optimizer stream is done, its masters cast into a weight slot
        from the compute stream's pool."""
        self.streams.wait_aside(stage)
        self.store.take_slot(f"w:{stage}", lambda n: torch.empty(n, dtype=torch.uint8, device=self.device))
        with torch.no_grad():
            for p in self.stages[stage].params:
                view = self.store.slot_view(stage, p)
                view.copy_(self.store.home[p])
                self.store.work[p].data = view

    def fetch_stage(self, stage: int, update: bool):
        """A weight slot for `stage`; the weights copied in, or with a pending GPU step its master,
        states and gradient into an optimizer slot (the step writes the weights)."""
        self._take_slot(f"w:{stage}")
        if update:
            if self.ring is not None and stage in self.ring.stages:  # NOTE: [Backward steps from disk]
                self.ring.load(stage)
            self.stepper.fetch(stage, self._take_slot(f"opt:{stage}"))
        own = self.sharding is not None and self.sharding.awaits(stage)  # this rank's piece; the GATHER brings the rest
        stepped_here = update and stage not in self.stepper.backward  # else the weights come as they are
        with torch.no_grad():
            for p in self.stages[stage].params:
                view = self.store.slot_view(stage, p)
                if own and not stepped_here:
                    self.store.mine(p, view).copy_(self.store.source_piece(p), non_blocking=True)
                elif p in self.store.from_master and not stepped_here:  # NOTE: [Weights from the master]
                    view.copy_(self.store.staging(stage, p).copy_(self.store.source[p], non_blocking=True))
                elif not stepped_here:
                    view.copy_(self.store.source[p], non_blocking=True)
                self.store.work[p].data = view

    def _offload(self, e: Event):
        buf = e.reads[0]
        if buf.startswith("w:") and self.sharding is not None and self.sharding.holds_gathered(e.stage):
            self.sharding.write_gathered(e.stage)
        elif buf.startswith("w:"):
            self.stepper.write_weights(e.stage)
        elif buf.startswith("opt:"):
            # NOTE: [Backward steps from disk]: states the ring brought this step go back to the file;
            # a step that does not optimize brought none, and its ring buffers hold other stages'
            if self.stepper.write_back(e.stage) and self.ring is not None and e.stage in self.ring.stages:
                self.ring.store(e.stage, self._landed())
        elif buf.startswith(("g:", "sg:")):  # gradients of streamed weights (sharded: this rank's shard) to the host
            self.gradients.offload(e.stage)
        elif self.stages[e.stage].placement.split is not None:  # NOTE: [Boundary tiles] in solver/boundary.py
            self._offload_split(e.stage)
        elif self.stages[e.stage].placement.outputs is Outputs.DISK:  # NOTE: [Activations on disk] in solver/disk_model.py
            outputs = {name: self.env[name] for name in self.stages[e.stage].outputs if name in self.env}
            self.act_disk.offload(e.stage, outputs, self._landed)
        else:
            for name in self.stages[e.stage].outputs:
                if name in self.env:
                    self._to_host(name, self.env[name])

    def _to_host(self, name: str, t: torch.Tensor) -> None:
        """`t` (an output, or its host part) into its page-locked host buffer, kept across steps."""
        host = self.host_act.get(name)
        if host is None or host.shape != t.shape or host.dtype != t.dtype:
            host = self.host_act[name] = self.pinned.empty(t.shape, t.dtype)
        host.copy_(t, non_blocking=True)

    def _offload_split(self, stage: int) -> None:
        """NOTE: [Boundary tiles] in solver/boundary.py: each output's host part to its host buffer and
        its disk part through the ring; its device part stays until the FREE after its last reader."""
        split, disk = self.stages[stage].placement.split, {}
        for name in self.stages[stage].outputs:
            if name in self.env:
                t = self.env[name]
                self.whole[name] = (t.shape, t.dtype) + _numels(t, split)
                kept, host, _ = self.whole[name][2:]
                if not t.is_contiguous():  # all of it to the host (`_numels`)
                    self._to_host(name, t)
                    continue
                flat = t.view(-1)
                if host:
                    self._to_host(name, flat[kept:kept + host])
                if kept + host < t.numel():
                    disk[name] = flat[kept + host:]
        if split.disk:
            self.act_disk.offload(stage, disk, self._landed)

    # NOTE: [Reloads from the compute pool] A reloaded output is made from the compute stream's pool,
    # as a slot is (NOTE: [Slots] in store.py), and filled on H2D. Made on H2D, as `.to` inside the
    # event makes it, it came from H2D's own pool, where it stayed cached once freed: compute could
    # not reuse it, and a plan at its cap paid for it in allocator retries, each a device-wide sync.
    # On the H200 (2026-12-04, bfeee0f) the 7B at 24 GiB with fp32 masters held 0.68 GiB on H2D,
    # none of it allocated, and retried 2-4 times a step: its two slowest windows (+51 and +67 ms)
    # were the two whose reload took 20-28 ms, priced 4.2.
    def _reload(self, e: Event):
        split = self.stages[e.stage].placement.split
        if split is not None:  # NOTE: [Boundary tiles] in solver/boundary.py: the whole, its device part copied in later
            disk = self.act_disk.reload(e.stage) if split.disk else {}
            for name in self.stages[e.stage].outputs:
                if name in self.whole:
                    shape, dtype, kept, host, _ = self.whole[name]
                    flat = self._empty(shape, dtype).view(-1)
                    if host:
                        flat[kept:kept + host].copy_(self.host_act[name].view(-1), non_blocking=True)
                    if name in disk:
                        flat[kept + host:].copy_(disk[name], non_blocking=True)
                    self.env[name] = flat.view(shape)
            if split.disk:
                self.act_disk.release(e.stage, self._landed())
            return
        if self.stages[e.stage].placement.outputs is Outputs.DISK:  # NOTE: [Activations on disk] in solver/disk_model.py
            for name, host in self.act_disk.reload(e.stage).items():
                self.env[name] = self._to_device(host, copy=True)  # the buffer goes back to the ring
            self.act_disk.release(e.stage, self._landed())
            return
        for name in self.stages[e.stage].outputs:
            if name in self.host_act:
                self.env[name] = self._to_device(self.host_act[name])

    def _to_device(self, host: torch.Tensor, copy: bool = False) -> torch.Tensor:
        """A reloaded output on the device, for compute; `copy`: a tensor of its own even on a CPU
        (where `.to` would return `host` itself). NOTE: [Reloads from the compute pool]"""
        if not self.cuda:
            return host.to(self.device, copy=copy)
        return self._empty(host.shape, host.dtype).copy_(host, non_blocking=True)

    def _empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        """A reloaded output's device buffer, from the compute pool on a GPU (NOTE: [Reloads from
        the compute pool])."""
        if not self.cuda:
            return torch.empty(shape, dtype=dtype, device=self.device)
        nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return self.streams.slot(nbytes, self.device).view(dtype).view(shape)

    def _free(self, e: Event):
        kind, _, idx = e.frees[0].partition(":")
        if kind == "rgrad":  # resident gradients: kept until the next step starts, unless the plan frees them
            self.gradients.free_issued(e.frees)
            return
        if kind == "host":  # host buffers are kept for the next step
            return
        if kind == "sg":  # a streamed stage's gradient shard, offloaded; resident ones stay until the next step
            if idx.isdigit():
                self.gradients.parked.pop(int(idx), None)
            return
        stage = self.stages[int(idx)]
        if kind == "w":
            self.release_weights(stage.index)
        elif kind == "opt":
            if e.frees[0] in self.store.slots:
                self.store.release_slot(e.frees[0])
        elif kind == "g":
            self.gradients.parked.pop(stage.index, None)
        elif kind == "act":
            if e.allocs:  # NOTE: [Boundary tiles] in solver/boundary.py: the kept part first
                for name in stage.outputs:
                    if self.whole.get(name, (0, 0, 0))[2]:
                        self.parts[name] = self.env[name].view(-1)[:self.whole[name][2]].clone()
            for name in stage.outputs:
                self.env.pop(name, None)
        elif kind == "part":  # NOTE: [Boundary tiles]: back into the reloaded whole
            for name in stage.outputs:
                if name in self.parts:
                    self.env[name].view(-1)[:self.whole[name][2]].copy_(self.parts.pop(name))
        elif kind == "saved":
            self.saved.pop(stage.index, None)
        elif kind == "grad":
            for name in stage.outputs:
                self.act_grads.pop(name, None)

    def _landed(self):
        """An event after the work queued so far on the current stream (None on the CPU, where it is done)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _take_slot(self, name: str) -> torch.Tensor:
        return self.store.take_slot(name, lambda n: self.streams.slot(n, self.device))

    def release_weights(self, stage: int) -> None:
        """A streamed (or cast-on-use) stage's weight slot goes; its work tensors are left empty."""
        for p in self.stages[stage].params:
            self.store.work[p].data = torch.empty(0, device=self.device, dtype=self.store.dtype[p])
        self.store.release_slot(f"w:{stage}")



def _numels(t: torch.Tensor, split: Split) -> tuple[int, int, int]:
    """Of output `t`, the elements that stay on the device, go to the host and go to disk (NOTE:
    [Boundary tiles] in solver/boundary.py), in memory order. An output not laid out in one piece
    goes to the host whole: the device and the disk then hold less than the plan, the host more."""
    return split.numels(t.numel()) if t.is_contiguous() else (0, t.numel(), 0)
