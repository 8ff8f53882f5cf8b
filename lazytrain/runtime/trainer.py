"""The runtime: replay a schedule's events to run forward, backward and the optimizer.

On the CPU, events run one after another in schedule order, which is valid for every stream. On a
GPU they run on CUDA streams ordered by their waits (streams.py), so transfers overlap compute and
the CPU optimizer overlaps both. Each event touches only the buffers it names, so a wrong schedule
fails loudly instead of computing something else.

A `Trainer` is a few parts, each its own object: `replay` runs the events (replay.py), `stepping`
the optimizer's side (stepping.py; each kind of step in steps.py), `sharding` sharded state's events
(sharding.py; None without it), `checkpoint` its DTensor state dicts (sharded_state.py). `gradients`
(gradients.py) carries gradients from the parts that make them to those that take them.

NOTE: [Memory cap]
The plan keeps the memory it allocates inside the budget, but PyTorch's caching allocator may
reserve more: freed blocks stay cached per stream and in the sizes first asked for. Measured on the
7B bench at 24 GiB: 16.7 GiB allocated at most, 66 GiB reserved. So on a GPU, `bind` caps the
process's allocator at the budget (`torch.cuda.set_per_process_memory_fraction`): past the cap the
allocator returns cached blocks to the device and retries before it fails. The cap is never below
`CAP_FLOOR`: there the allocator's own rounding (2 MiB pages, 20 MiB segments, per stream) would
dominate a tiny plan. The cap sits `CAP_MARGIN` below the budget: with expandable segments the
allocator's reserved peak went 6-8 MiB past a cap at the budget on the H200 (2026-11-30).
`cap_memory=False` leaves the allocator alone (and any cap set before).
"""

from __future__ import annotations

from types import ModuleType

import torch

from lazytrain.errors import ScheduleMismatch
from lazytrain.ir.events import Event
from lazytrain.runtime import host_weights, model_sync
from lazytrain.runtime.binding import (bind_tensors, check_batch, check_device, indexed, pin_streamed_masters,
                                       place_resident_masters, shard)
from lazytrain.runtime.capacity import check_host, check_room
from lazytrain.runtime.data_parallel import DataParallel
from lazytrain.runtime.disk_masters import DiskMasters, masters_on_disk
from lazytrain.runtime.disk_tier import bind_disk_tier
from lazytrain.runtime.forward_only import forward_loss, whole_step_reason
from lazytrain.runtime.fused import choose, fuse
from lazytrain.runtime.gpu_step import GpuStepper
from lazytrain.runtime.gradients import Gradients
from lazytrain.runtime.groups import Groups
from lazytrain.runtime.optim import master_dtype, staged_optimizer
from lazytrain.runtime.pinned import PinnedArena
from lazytrain.runtime.replay import Replay
from lazytrain.runtime.sharded_state import ShardedCheckpoint
from lazytrain.runtime.sharding import Sharding
from lazytrain.runtime.store import ParamStore
from lazytrain.runtime.stepping import Stepping
from lazytrain.runtime.streams import CudaStreams, SerialStreams


CAP_FLOOR = 1 << 30  # NOTE: [Memory cap]
CAP_MARGIN = 64 << 20


class Trainer:
    """`schedule.bind(model, lr=...)` returns one. `forward_backward(batch)` leaves each parameter's
    gradient in `.grad`; `step(batch)` also applies AdamW. `optimizer` is a `torch.optim.Optimizer`
    (LR schedulers attach to it), and `state_dict()` / `load_state_dict()` save and restore it.
    `device` (default: where the model is) is where compute runs; the model's own parameters stay
    the masters (fp32, bf16 if compiled with `--master-weights bf16`, whatever dtype the model was
    built in); on a GPU, those of resident
    stages move to the device (NOTE: [Resident masters on the device]). On a GPU the process's
    allocator is capped at the budget unless `cap_memory=False` (NOTE: [Memory cap]).
    A schedule compiled with `--world-size N` trains data parallel over `process_group` (default:
    torch.distributed's default group), which must have N ranks: gradients are averaged over them
    and the loss returned is the global batch's (NOTE: [Data parallel] in data_parallel.py); with sharded
    state each rank keeps 1/N of it (NOTE: [Sharded state] in sharding.py), and `sharded_state_dict()`
    / `load_sharded_state_dict()` give it to torch.distributed.checkpoint (NOTE: [Sharded checkpoints]).
    `fuse_stages=True` runs each block kind's stage body compiled by torch.compile (NOTE: [Fused stages]
    in fused.py); the first steps then compile. None (the default) follows the schedule's `FUSED` on a
    GPU, and stays eager on the CPU; a choice other than `FUSED` warns (the plan priced the other)."""

    def __init__(self, module: ModuleType, model: torch.nn.Module, *, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.01, max_grad_norm: float | None = None, device=None, foreach=None, fused=None,
                 serial_optimizer: bool = False, cap_memory: bool = True, process_group=None,
                 offload_dir: str | None = None, disk_masters: DiskMasters | None = None,
                 fuse_stages: bool | None = None):
        self.m = module
        self.model = model
        self.events: tuple[Event, ...] = module.EVENTS
        model_sync.land_previous(model)  # a trainer bound to it before: start from its updated weights
        tensors = bind_tensors(module, model)
        for name, t in tensors.items():  # NOTE: [Masters in the schedule's dtype] in optim.py
            if module.PLACEHOLDERS[name][0] == "param" and t.dtype != master_dtype(module, t.dtype):
                t.data = t.data.to(master_dtype(module, t.dtype))
        self.device = torch.device(device) if device is not None else next(iter(tensors.values())).device
        check_device(module, self.device)
        self.device = indexed(self.device)
        self.cuda = self.device.type == "cuda"
        if self.cuda:  # NOTE: [Room on the GPU], [Room on the host] in capacity.py
            check_room(module, self.device)
            check_host(module)
        # NOTE: [Fused stages] in fused.py: the same stages, their bodies compiled
        self.fused = choose(module, self.device, fuse_stages)
        self.stages = fuse(module.STAGES, module.FINGERPRINT, planned=self.cuda and bool(getattr(module, "FUSED", False))) \
            if self.fused else module.STAGES
        self.dp = DataParallel.for_schedule(module, process_group, self.device)  # NOTE: [Data parallel]
        if self.cuda and cap_memory:  # NOTE: [Memory cap]
            total = torch.cuda.get_device_properties(self.device).total_memory
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            torch.cuda.set_per_process_memory_fraction(min(1.0, max(module.BUDGET - CAP_MARGIN, CAP_FLOOR) / total), index)
        self.sharded = self.dp is not None and getattr(module, "SHARDED", False)  # NOTE: [Sharded state] in sharding.py
        layouts, pieces = (shard(module, tensors, self.dp) if self.sharded else (None, None))
        self.pinned = PinnedArena(self.cuda)  # NOTE: [Pinned arena] in pinned.py
        # NOTE: [Sharded host weights] in host_weights.py: the streamed weights' pieces; the model keeps placeholders
        held = host_weights.hold(module, tensors, layouts, self.pinned) \
            if self.sharded and getattr(module, "SHARDED_WEIGHTS", False) else {}
        self.model_weights = host_weights.ModelWeights(module, tensors, held) if held else None
        if self.cuda:
            pin_streamed_masters(module, tensors, self.pinned, skip=held)
            if not self.sharded:
                place_resident_masters(module, tensors, self.device)
        # NOTE: [Masters on disk] in solver/disk_model.py: in the file they were loaded into, or in a new one
        if disk_masters is None and masters_on_disk(module):
            disk_masters = DiskMasters(module, offload_dir)
        self.disk_masters = disk_masters
        self.store = ParamStore(module, tensors, self.device, self.pinned, layouts, pieces, disk_masters, held)
        self.streams = CudaStreams(self.device) if self.cuda else SerialStreams()
        self.groups = Groups(self.stages, module.SHARED)
        self.gradients = Gradients(self.stages, self.groups, self.store, self.pinned, clipped=max_grad_norm is not None)
        if max_grad_norm is not None and module.CLIPPING == "off":  # NOTE: [Gradient clipping] in stepping.py
            raise ScheduleMismatch(
                f"max_grad_norm={max_grad_norm} asks for gradient clipping, but this schedule was compiled with "
                "--clipping off, which plans none: recompile with --clipping exact (or previous-norm), or bind "
                "without max_grad_norm")
        # NOTE: [Resident gradients freed at their step] in solver/footprint.py
        if serial_optimizer and (self.grads_freed or any(s.placement.kind == "backward" for s in self.stages)):
            raise ScheduleMismatch("serial_optimizer runs every optimizer step after backward, but this schedule steps "
                                   "some blocks inside it (NOTE: [Backward steps], [Resident gradients freed at their "
                                   "step]); bind without serial_optimizer")
        chosen = getattr(module, "OPTIMIZER_STATES", "32bit")
        param_groups = []
        for names, states in [(s.params, s.states) for s in self.stages] + [(module.SHARED, chosen)]:
            group = {"params": [self.store.home[p] for p in names], "states": states}
            if self.sharded:  # the pieces' places in their parameters: the bf16 rounding noise follows them;
                group["offsets"] = [self.store.offset(p) for p in names]  # and their whole sizes: 8-bit or
                group["numels"] = [self.store.master[p].numel() for p in names]  # 32-bit states follow them
            if fused is not None or self.cuda:
                group["fused"] = fused if fused is not None else True
            param_groups.append(group)
        self.optimizer = staged_optimizer(chosen, param_groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                          foreach=foreach)
        tier = bind_disk_tier(module, self.stages, self.optimizer, self.store, self.pinned, self.device, offload_dir,
                              disk_masters)
        self.disk_states, self.act_disk = tier.states, tier.acts
        self.stepper = GpuStepper(self.store, self.optimizer, {s.index: s.params for s in self.stages
                                                               if s.placement.device_stepped and s.index not in tier.stepped},
                                  self.gradients.host, self.pinned, tier.in_backward)
        # disk-stepped stages' jobs, one at a time in one GPU slot (the schedule's `dstep` buffer)
        self.disk_stepper = GpuStepper(self.store, self.optimizer, tier.stepped, self.gradients.host, self.pinned)
        # the parts
        self.sharding = Sharding(self.stages, self.groups, self.store, self.dp, self.streams, self.gradients,
                                 frozenset(self.stepper.params), self.device) if self.sharded else None
        self.stepping = Stepping(self.stages, self.groups, self.store, self.optimizer, self.streams, self.gradients,
                                 self.sharding, self.dp, self.stepper, self.disk_stepper, self.disk_states, tier.slot,
                                 self.device, max_grad_norm=max_grad_norm, clipping=module.CLIPPING,
                                 serial=serial_optimizer)
        self.replay = Replay(module, self.stages, self.store, self.streams, self.stepper, self.gradients, self.stepping, self.sharding,
                             self.dp, self.act_disk, self.disk_states.ring if self.disk_states is not None else None,
                             self.pinned, self.device)
        self.checkpoint = ShardedCheckpoint(self.groups, module.PLACEHOLDERS, self.store, self.optimizer, self.dp,
                                            self.device, self.sharded)
        self.record_timeline = False  # set True to time every event of each step
        self.timeline: list[tuple[int, float, float]] = []  # (event id, start s, end s) of the last step
        if self.cuda:  # bind's copies ran on the default stream; compute has its own
            torch.cuda.synchronize(self.device)
        # stepped since the last sync_model (NOTE: [Model sync hooks] in model_sync.py); with sharded host
        # weights the model holds placeholders until one (NOTE: [Sharded host weights] in host_weights.py)
        self._model_behind = bool(held)
        if self.dp is not None:  # every rank bound the same schedule and weights; none steps before all have bound
            self.dp.check_agree(module.CHECKSUM, {module.PLACEHOLDERS[p][1]: None if p in held else t
                                                  for p, t in self.store.master.items()})
        model_sync.attach(self, model)

    # ---- public API ---------------------------------------------------------------------------
    def forward_backward(self, batch: dict) -> torch.Tensor:
        """Loss of `batch`; gradients accumulate into the model's `.grad` as `loss.backward()` would."""
        return self._run(batch, optimize=False)

    def loss(self, batch: dict) -> torch.Tensor:
        """Loss of `batch`, no gradient made or kept: an evaluation. The stages' forwards alone,
        without autograd, within the plan's memory (NOTE: [Forward-only evaluation] in
        forward_only.py); with several ranks or the masters on disk, the whole step with its gradients
        discarded (unlike `forward_backward`'s `.grad`, which no plan counts, they live in the step's
        own buffers and go with them). Pending updates are applied first, as `zero_grad` does."""
        self.zero_grad()
        if whole_step_reason(self) is not None:
            return self._run(batch, optimize=False, keep_grads=False)
        with self.streams.compute_context():
            self.replay.begin(check_batch(self.m, batch, self.device))
            try:
                forward_loss(self.replay)
            finally:
                if self.cuda:  # the loss and the freed slots: nothing of the evaluation outlives it
                    torch.cuda.synchronize(self.device)
            return self.replay.end()

    def step(self, batch: dict) -> torch.Tensor:
        """One training step: fresh gradients, forward, backward, AdamW. Returns the loss.
        With exact clipping host steps may still run when it returns (NOTE: [Host step deadlines] in
        stepping.py), and GPU-stepped streamed stages apply their update
        at the next forward's prefetch; `synchronize()` (which `state_dict`, `sync_model` and
        `zero_grad` call) finishes both. The model's `state_dict()` and forward call `sync_model()`
        first (NOTE: [Model sync hooks] in model_sync.py)."""
        # Stages whose host step still runs clear their own gradients when done; waiting here
        # would serialise the host optimizer with this step's forward.
        self.gradients.clear(s for s in self.groups.order if not self.stepping.running(s))
        self._model_behind = True
        return self._run(batch, optimize=True)

    def _run(self, batch: dict, optimize: bool, keep_grads: bool = True) -> torch.Tensor:
        """One step's events, then the steps that waited for its gradient norm (NOTE: [Gradient
        clipping] in stepping.py)."""
        if self.model_weights is not None:  # NOTE: [Sharded host weights] in host_weights.py
            self.model_weights.drop()
        with self.streams.compute_context():  # NOTE: [Optimizer stream] in stepping.py
            self.replay.begin(check_batch(self.m, batch, self.device))
        self.gradients.begin()
        if self.sharding is not None:  # NOTE: [Sharded state] in sharding.py
            self.sharding.begin(optimize)
        turn = self.stepping.begin(optimize)
        self.streams.begin(self.record_timeline)
        try:
            self.replay.run(turn)
            coef = self.stepping.after_backward(turn)
            if optimize and (turn.deferred or self.stepper.params):
                if coef is None:
                    self.stepping.skip()
                    self.zero_grad()
                else:
                    for event in turn.in_order():
                        self.stepping.run(event, coef)
                        if event.stage in turn.gathers:
                            g = turn.gathers[event.stage]
                            self.streams.run(g, lambda g=g: self.sharding.gather(g))
                    self.stepping.record_gpu_steps(coef)
                    if self.stepping.serial:
                        self.synchronize()
            if optimize and not turn.deferred:  # host steps end inside their step (NOTE: [Host step deadlines])
                self.stepping.wait_host_steps(disk_jobs=False)
        except BaseException:
            self.streams.abandon()  # the caller's GIL switch interval back (NOTE: [Host steps and the GIL])
            raise
        timeline = self.streams.finish()
        loss = self.replay.end()
        if not optimize and keep_grads:
            self.gradients.absorb_all()
        elif not optimize:
            self.gradients.discard(self.groups.order)
        self.gradients.end()
        self.timeline = timeline or []
        return loss

    def zero_grad(self) -> None:
        self.synchronize()
        self.gradients.clear(self.groups.order)

    def synchronize(self) -> None:
        """Finish every optimizer step: wait for host steps still running (with exact clipping they
        overlap the next step), and apply GPU steps of streamed stages still waiting for the next prefetch."""
        self.stepping.wait_host_steps()
        if self.cuda:  # every stream: what follows may read on any of them
            torch.cuda.synchronize(self.device)
        if self.disk_states is not None:  # the ring's writes after the last step's backward
            self.disk_states.drain()
        if self.stepper.pending:
            self._flush_gpu_steps()
        if self.sharding is not None and self.sharding.awaiting():  # NOTE: [Sharded state] in sharding.py: a collective
            self._land_gathers()

    def _flush_gpu_steps(self) -> None:
        """The pending updates' events, run back to back on the current stream (`synchronize`
        has waited for every stream first)."""
        for s in sorted(self.stepper.pending):
            self.replay.fetch_stage(s, update=True)
            if self.stepper.step(s, self.groups.index(s)) and self.sharding is not None:
                self.sharding.gather_stage(s)
            self.stepper.write_weights(s)
            self.stepper.write_back(s)
            self.replay.release_weights(s)
            self.store.release_slot(f"opt:{s}")
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _land_gathers(self) -> None:
        """Host-stepped streamed stages' updates, gathered now instead of at their next prefetch."""
        for s in self.sharding.awaiting():
            self.replay.fetch_stage(s, update=False)
            self.sharding.gather_stage(s)
            self.sharding.write_gathered(s)
            self.replay.release_weights(s)
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def state_dict(self) -> dict:
        self.synchronize()
        if self.disk_states is None:
            return self.optimizer.state_dict()
        with self.disk_states.materialized():  # the states on disk, mapped from the file for the checkpoint
            return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.synchronize()
        # GPU-stepped streamed stages keep their states in page-locked host buffers, which the
        # prefetch reads at full speed; loading makes fresh pageable copies, so the loaded values go
        # back into those buffers (or into new page-locked ones).
        homes = [self.store.home[p] for names in self.stepper.params.values() for p in names]
        held = [self.optimizer.state.get(h, {}) for h in homes]
        self.optimizer.load_state_dict(state)
        for h, old in zip(homes, held):
            loaded = self.optimizer.state.get(h, {})
            for k, v in loaded.items():
                if torch.is_tensor(v) and v.device.type == "cpu":
                    buf = old.get(k)
                    if not torch.is_tensor(buf) or buf.shape != v.shape or buf.dtype != v.dtype:
                        buf = self.pinned.empty(v.shape, v.dtype)
                    loaded[k] = buf.copy_(v)
        if self.disk_states is not None:
            self.disk_states.absorb()
        self.synchronize()

    def memory_report(self) -> dict:
        """The runtime's own buffers: the most weight and optimizer slot memory live at once on the
        device, and page-locked host buffers (sources to prefetch from, gradient and activation pools)."""
        return {"slot_bytes": self.store.slot_bytes, "pinned_bytes": self.pinned.reserved}

    def sync_model(self) -> None:
        """Finish every optimizer step and copy weights stepped on the device back into the model's
        own (master) parameters. The model's `state_dict()` and forward call it when needed (NOTE:
        [Model sync hooks]); reading `model.parameters()` directly needs it called first."""
        self.synchronize()
        with torch.no_grad():
            for p, home in self.store.home.items():
                master = self.store.master[p]
                if self.sharded:  # the full weights: on the device (resident), or the master itself (streamed)
                    if p not in self.store.streamed and self.store.work[p] is not master:
                        master.copy_(self.store.work[p])
                elif home is not master:
                    master.copy_(home)
        if self.model_weights is not None:  # NOTE: [Sharded host weights] in host_weights.py: a collective
            self.model_weights.land(self.store, lambda s: self.replay.fetch_stage(s, update=False),
                                    self.sharding.gather_stage, self.replay.release_weights)
            if self.cuda:
                torch.cuda.synchronize(self.device)
        self._model_behind = False

    def sharded_state_dict(self) -> dict:
        """NOTE: [Sharded checkpoints] in sharded_state.py."""
        self.synchronize()
        return self.checkpoint.state_dict()

    def load_sharded_state_dict(self, sd: dict) -> None:
        """Load what `sharded_state_dict()` gave (here, or filled by torch.distributed.checkpoint from
        a save on any number of ranks), then rebuild the weights from the masters."""
        self.synchronize()
        self.checkpoint.load(sd)
        self._rebuild_weights()

    def whole_state(self, optimizer_state: dict, model_state: dict) -> dict:
        """`load_sharded_state_dict`'s entries, whole, from torch.optim's format of a trainer of the same
        schedule's stages (one process, or ranks with replicated state) and the model's weights (the
        masters). Raises ValueError where the groups do not match this trainer's."""
        return self.checkpoint.whole_state(optimizer_state, model_state)

    def _rebuild_weights(self) -> None:
        """The full weights from the loaded masters: this rank's pieces, then every stage gathered."""
        for s in self.groups.order:
            names = self.groups.names(s)
            if not names:
                continue
            streamed = s >= 0 and self.stages[s].placement.streamed
            (self.store.refresh_source if streamed else self.store.refresh_work)(names)
            if self.sharding is None:
                continue
            self.sharding.updated(s)
            if not streamed:  # a streamed stage's: by synchronize(), through its weight slot
                self.sharding.gather_stage(s)
        if self.model_weights is not None:  # landed before the load: gathered again (NOTE: [Sharded host weights])
            self.model_weights.drop()
        self._model_behind = True
        self.sync_model()

    # ---- the parts' state, read by tests and tools ------------------------------------------------
    @property
    def grads_freed(self) -> frozenset[int]:
        """Resident stages whose gradients go at their step (NOTE: [Resident gradients freed at their
        step] in solver/footprint.py)."""
        return self.gradients.freed

    @property
    def last_grad_norm(self) -> float | None:
        """NOTE: [Gradient clipping] in stepping.py."""
        return self.stepping.last_grad_norm

    @property
    def skipped_steps(self) -> int:
        """Steps whose gradient norm was not finite: their update skipped (NOTE: [Gradient clipping])."""
        return self.stepping.skipped_steps
