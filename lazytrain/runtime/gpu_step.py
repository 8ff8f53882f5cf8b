"""Optimizer steps of streamed stages on the device (NOTE: [GPU-stepped streamed stages] in solver/formulation.py).

`step()` leaves such a stage's gradient in its page-locked host buffer and records a *pending*
update: the clipping coefficient and the stage's hyperparameters at that moment (an LR scheduler
stepped afterwards must not change them). The next forward's prefetch of the stage applies it:

    PREFETCH opt:S (h2d)      fp32 master, optimizer states and the gradient into an opt slot
    OPT_STEP S     (compute)  AdamW on those device twins; new compute-dtype weights into the weight slot
    OFFLOAD w:S    (d2h)      the new weights to the host copy the backward prefetch reads
    OFFLOAD opt:S  (d2h)      master and states back to their homes on the host

Without a pending update the prefetch is a plain weight prefetch. `flush()` applies pending
updates at once (checkpoints, `sync_model`), so nothing is lost when training stops.
The optimizer's own state dict keeps holding the host tensors, so `state_dict()` sees them.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

import torch

from lazytrain.runtime.carve import Carver
from lazytrain.runtime.optim import round_stochastic_, state_piece, twin_pieces
from lazytrain.runtime.pinned import PinnedArena
from lazytrain.runtime.store import ParamStore
from lazytrain.sizes import TWIN_CHUNK


@dataclass
class _Update:
    hyper: dict  # the group's hyperparameters when step() was called
    coef: float  # gradient clipping coefficient
    master: dict[str, torch.Tensor] = field(default_factory=dict)  # fp32 twins on the device
    grad: dict[str, torch.Tensor] = field(default_factory=dict)  # gradients as they arrived
    grad32: dict[str, torch.Tensor] = field(default_factory=dict)
    arrived: dict[str, torch.Tensor] = field(default_factory=dict)  # bf16 masters as they arrived
    state: dict[str, dict] = field(default_factory=dict)  # optimizer state twins on the device
    noise: torch.Tensor | None = None  # bf16 masters: int32 rounding noise of the largest tensor, from the slot
    # a step in backward: the fp32 twins of its largest tensor, reused tensor after tensor (NOTE:
    # [Backward step twins] in solver/footprint.py); None for a bf16 master's or where unused
    twin: torch.Tensor | None = None
    grad_twin: torch.Tensor | None = None
    names: tuple[str, ...] = ()  # the parameters fetched: the stage's, or one of them (`step_from_disk`)


# NOTE: [First step's states] A stage's first update on the device has no states on the host yet.
# Left to the optimizer, it would make them itself, from the caching allocator, beside the `opt:S`
# slot that the plan sized to hold them: on the 7B bench with 32-bit states (8 bytes a parameter,
# 1.7 GiB a layer) that ran out of memory under a 24 GiB cap. So `fetch` asks the optimizer for
# the states its first step would make (`fresh_state`), cut from the slot like every later update's.


class GpuStepper:
    def __init__(self, store: ParamStore, optimizer, params: dict[int, tuple[str, ...]], host_grad: dict,
                 pinned: PinnedArena, backward: frozenset[int] = frozenset()):
        self.store, self.optimizer, self.params, self.host_grad, self.pinned = store, optimizer, params, host_grad, pinned
        self.backward = backward  # stages stepped right after their backward, on the device's gradient (NOTE: [Backward steps])
        self.pending: dict[int, _Update] = {}  # recorded by step(), not yet fetched
        self.live: dict[int, _Update] = {}  # fetched, not yet written back

    def record(self, stage: int, hyper: dict, coef: float) -> None:
        self.pending[stage] = _Update(hyper, coef)

    def fetch(self, stage: int, slot: torch.Tensor, names: tuple[str, ...] | None = None) -> None:
        """Copy master, gradient and states of `stage` (of its parameters `names`) into `slot` (on the
        current stream)."""
        u = self.pending.pop(stage)
        u.names = tuple(names) if names is not None else self.params[stage]
        carve = Carver(slot)
        largest = max(self.store.home[p].numel() for p in u.names)
        bf16 = any(self.store.home[p].dtype != torch.float32 for p in u.names)
        in_backward = stage in self.backward  # NOTE: [Backward step twins] in solver/footprint.py
        twin = min(largest, TWIN_CHUNK) if in_backward and bf16 else largest
        if bf16:  # planned: NOISE_BYTES in solver/footprint.py
            u.noise = carve.take((twin,), torch.int32)
        if in_backward:
            u.twin = carve.take((twin,), torch.float32) if bf16 else None
            u.grad_twin = carve.take((twin,), torch.float32)
        for p in u.names:
            # the master, or this rank's piece (NOTE: [Sharded state]), or where a master on disk was
            # read to (NOTE: [Masters on disk] in solver/disk_model.py)
            master = self.store.staged.get(p, self.store.home[p]).detach()
            if master.dtype == torch.float32:
                u.master[p] = carve.take(master.shape, torch.float32).copy_(master, non_blocking=True)
            elif in_backward and self.store.source_is_master(p):  # NOTE: [Backward step twins]: the
                # weight slot's prefetch brings the master itself; the step rounds into it
                u.arrived[p] = self.store.slot_view(stage, p)
            else:  # a bf16 master comes in as it is; step() widens it into an fp32 twin (the copy
                # streams run copies only: a kernel there waits for SMs and holds up the copies behind it)
                u.arrived[p] = carve.take(master.shape, master.dtype).copy_(master, non_blocking=True)
                if not in_backward:  # a step in backward takes its twins tensor by tensor (`_step_in_pieces`)
                    u.master[p] = carve.take(master.shape, torch.float32)
            if not in_backward:  # a step in backward reads the gradient on the device (`step`)
                host = self.host_grad[p]
                u.grad[p] = carve.take(host.shape, host.dtype).copy_(host, non_blocking=True)
                u.grad32[p] = carve.take(master.shape, torch.float32)
            elif master.dtype == torch.float32:
                u.grad32[p] = u.grad_twin[:master.numel()].view(master.shape)
            home = self.optimizer.state.get(self.store.home[p], {})
            if home:
                u.state[p] = {k: carve.take(v.shape, v.dtype).copy_(v, non_blocking=True) if torch.is_tensor(v) else v
                              for k, v in home.items()}
            else:  # NOTE: [First step's states]
                fp32 = u.master.get(p)  # the twin's shape, dtype and device, where it has no twin of its own:
                if fp32 is None:  # a view of one element of the twins (bitsandbytes reads the device)
                    fp32 = u.grad_twin.as_strided(master.shape, (0,) * master.dim())
                u.state[p] = self.optimizer.fresh_state(stage, fp32, carve.take, position=self.params[stage].index(p))
        self.live[stage] = u

    def step(self, stage: int, group: int, into: dict[str, torch.Tensor] | None = None,
             grads: dict | None = None) -> bool:
        """AdamW on the twins, then the compute-dtype weights into the stage's weight slot (sharded:
        into this rank's piece of it, which a GATHER completes), or into `into`'s tensors. `grads`: a
        step in backward's gradients, on the device. False: no update was fetched."""
        u = self.live.get(stage)
        if u is None:
            return False
        if grads is not None:
            u.grad.update(grads)
        if stage in self.backward:  # NOTE: [Backward step twins] in solver/footprint.py: one tensor at a time
            for p in u.names:
                if p in u.arrived:
                    self._step_in_pieces(stage, group, u, p, into)
                else:
                    self._step(stage, group, u, (p,), into)
            return True
        self._step(stage, group, u, u.names, into)
        return True

    def _step_in_pieces(self, stage: int, group: int, u: _Update, p: str, into) -> None:
        """A bf16 master's tensor `p` stepped in backward through the update's twins, `TWIN_CHUNK`
        elements at a time where its state can be cut there (NOTE: [Twin chunks] in sizes.py), then
        its compute copy written."""
        if u.grad.get(p) is None:  # no gradient (not stepped, as torch skips it)
            return
        arrived, grad, whole = u.arrived[p].view(-1), u.grad[p].reshape(-1), u.state[p]
        numel, i, seed = arrived.numel(), self.params[stage].index(p), None
        pieces = twin_pieces(whole, numel)
        for lo, hi in pieces:
            # a piece larger than the twins (a state that cannot be cut) takes memory of its own
            twin = u.twin[:hi - lo] if hi - lo <= u.twin.numel() else torch.empty(hi - lo, device=arrived.device)
            grad32 = u.grad_twin[:hi - lo] if hi - lo <= u.grad_twin.numel() else torch.empty_like(twin)
            if len(pieces) == 1:  # the tensor whole, in its shape (its state's)
                twin, grad32 = twin.view(u.arrived[p].shape), grad32.view(u.arrived[p].shape)
            with torch.no_grad():
                twin.copy_(arrived[lo:hi].view(twin.shape))
                twin.grad = grad32.copy_(grad[lo:hi].view(twin.shape))
                if u.coef != 1.0:
                    twin.grad.mul_(u.coef)
            piece = whole if len(pieces) == 1 else state_piece(whole, lo, hi, numel)
            state = defaultdict(dict, {twin: piece})
            self.optimizer.step_on(group, [twin], state, u.hyper, positions=[i])
            stepped = state[twin]
            twin.grad = None
            seed = self.optimizer.sr_seed(group, i, stepped) if seed is None else seed
            with torch.no_grad():
                round_stochastic_(arrived[lo:hi], twin.view(-1), seed, u.noise if hi - lo <= u.noise.numel() else None,
                                  self.store.offset(p) + lo)
        if len(pieces) == 1:
            u.state[p] = stepped  # the first step creates the state
        else:
            whole["step"] = stepped["step"]  # every piece stepped the count it started from once
        weights = into[p] if into is not None else self.store.mine(p, self.store.work[p].data)
        if weights.data_ptr() != u.arrived[p].data_ptr():  # else the step rounded into the weights
            with torch.no_grad():
                weights.copy_(u.arrived[p].view(weights.shape))

    def _step(self, stage: int, group: int, u: _Update, names: tuple[str, ...], into) -> None:
        """`step` of the parameters `names` of `u`, in one call of the optimizer."""
        with torch.no_grad():
            for p in names:
                if p in u.arrived:
                    u.master[p].copy_(u.arrived[p])
                if u.grad.get(p) is None:  # no gradient (not stepped, as torch skips it)
                    u.master[p].grad = None
                    continue
                g = u.grad32[p].copy_(u.grad[p])
                if u.coef != 1.0:
                    g.mul_(u.coef)
                u.master[p].grad = g
        state = defaultdict(dict, {u.master[p]: u.state[p] for p in names})
        self.optimizer.step_on(group, [u.master[p] for p in names], state, u.hyper,
                               positions=[self.params[stage].index(p) for p in names])
        with torch.no_grad():
            for p in names:
                i = self.params[stage].index(p)  # its place in the stage: the rounding seed's
                u.state[p] = state[u.master[p]]  # the first step creates the state
                u.master[p].grad = None
                weights = into[p] if into is not None else self.store.mine(p, self.store.work[p].data)
                if self.store.home[p].dtype == torch.float32:
                    weights.copy_(u.master[p].view(weights.shape))
                else:  # NOTE: [bf16 master weights] in optim.py: the rounded master, then its compute copy
                    seed = self.optimizer.sr_seed(group, i, u.state[p])
                    rounded = round_stochastic_(u.arrived[p], u.master[p], seed, u.noise, self.store.offset(p))
                    weights.copy_(rounded.view(weights.shape))

    def write_weights(self, stage: int, into: dict[str, torch.Tensor] | None = None) -> None:
        """New compute-dtype weights (in the stage's weight slot, or in `into`'s tensors) to the host
        copy that prefetches read (on the current stream); where that copy is the master, or prefetches
        cast from the fp32 master, this is the master's write-back."""
        u = self.live.get(stage)
        if u is None:
            return
        for p in u.names:
            if p in self.store.from_master:  # NOTE: [Weights from the master] in solver/footprint.py: the master
                self.store.master[p].detach().copy_(u.master[p], non_blocking=True)
            else:
                new = into[p] if into is not None else self.store.work[p].data
                # NOTE: [Sharded host weights] in host_weights.py: this rank's piece alone
                self.store.source[p].copy_(self.store.mine(p, new) if p in self.store.held else new, non_blocking=True)

    def step_from_disk(self, stage: int, group: int, hyper: dict, coef: float, slot: torch.Tensor) -> None:
        """A disk-stepped stage's update in `slot` (NOTE: [Disk-stepped stages] in
        solver/disk_model.py), its states already loaded into host memory: one parameter at a time,
        its master, states and gradient in, the step, its new weights, master and states out, all on
        the current stream (which orders each parameter's use of the slot after the last one's), and
        the caller synchronizes it before the states go back to disk."""
        for p in self.params[stage]:
            carve = Carver(slot)
            into = {p: carve.take(self.store.master[p].shape, self.store.dtype[p])}
            self.record(stage, hyper, coef)
            self.fetch(stage, slot[carve.offset:], (p,))
            self.step(stage, group, into)
            self.write_weights(stage, into)
            self.write_back(stage)

    def write_back(self, stage: int) -> bool:
        """Master and states to their host homes (on the current stream); False where `stage` was not
        fetched for an update this step (a step that does not optimize), which leaves them alone."""
        u = self.live.pop(stage, None)
        if u is None:
            return False
        pin = self.store.cuda
        for p in u.names:
            if p in self.store.separate:  # a mixed-precision master's piece (NOTE: [Sharded state])
                self.store.home[p].copy_(u.master[p], non_blocking=True)
            elif not self.store.source_is_master(p):  # else it went back as the weights
                master = self.store.staged.get(p, self.store.master[p]).detach()  # NOTE: [Masters on disk]
                master.copy_(u.arrived.get(p, u.master[p]), non_blocking=True)
            home = self.store.home[p]
            host = self.optimizer.state.get(home)
            # The states are carved from the opt slot, whose FREE waits for this copy (NOTE: [Slots]
            # in store.py); a host scalar (AdamW's unfused `step`) is the optimizer's own.
            if not host:  # first update: the host copies are made once
                host = {k: self.pinned.empty(v.shape, v.dtype) if torch.is_tensor(v) and v.is_cuda == pin else v
                        for k, v in u.state[p].items()}
                self.optimizer.state[home] = host
            for k, v in u.state[p].items():
                if torch.is_tensor(v) and host[k] is not v:
                    host[k].copy_(v, non_blocking=True)
                else:
                    host[k] = v
        return True
