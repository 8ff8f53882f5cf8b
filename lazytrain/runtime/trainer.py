"""The runtime: replay a schedule's events to run forward, backward and the optimizer.

On the CPU, events run one after another in schedule order, which is valid for every stream. On a
GPU they run on CUDA streams ordered by their waits (streams.py), so transfers overlap compute and
the CPU optimizer overlaps both. Each event touches only the buffers it names, so a wrong schedule
fails loudly instead of computing something else.

The event handlers are in replay.py, the optimizer's side in stepping.py.

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

import tempfile
from concurrent.futures import Future
from types import ModuleType

import torch

from lazytrain.errors import ScheduleMismatch
from lazytrain.ir.events import Event, Kind
from lazytrain.ir.placement import Outputs, Tier
from lazytrain.runtime import model_sync
from lazytrain.runtime.data_parallel import DataParallel
from lazytrain.runtime.disk_acts import DiskActivations
from lazytrain.runtime.disk_masters import DiskMasters, masters_on_disk
from lazytrain.runtime.disk_states import DiskStates
from lazytrain.runtime.gpu_step import GpuStepper
from lazytrain.runtime.optim import master_dtype, staged_optimizer
from lazytrain.runtime.pinned import PinnedArena
from lazytrain.runtime.replay import Replay
from lazytrain.runtime.sharded_state import ShardedState
from lazytrain.runtime.sharding import ShardLayout
from lazytrain.runtime.store import OPT_SLACK, ParamStore, streamed_params
from lazytrain.runtime.stepping import Stepping
from lazytrain.runtime.streams import CudaStreams, SerialStreams


CAP_FLOOR = 1 << 30  # NOTE: [Memory cap]
CAP_MARGIN = 64 << 20


def indexed(device: torch.device) -> torch.device:
    """`device` with its index: "cuda" is the current GPU. Masters already on a GPU (NOTE: [Masters
    built in place] in store.py) sit on "cuda:0", which is not equal to "cuda": compared with the
    bare name, each would get a second copy on the device beside it."""
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device


def _fmt(shape, dtype) -> str:
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}"


class Trainer(Replay, Stepping, ShardedState):
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
    / `load_sharded_state_dict()` give it to torch.distributed.checkpoint (NOTE: [Sharded checkpoints])."""

    def __init__(self, module: ModuleType, model: torch.nn.Module, *, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.01, max_grad_norm: float | None = None, device=None, foreach=None, fused=None,
                 serial_optimizer: bool = False, cap_memory: bool = True, process_group=None,
                 offload_dir: str | None = None, disk_masters: DiskMasters | None = None):
        self.m = module
        self.model = model
        self.stages = module.STAGES
        self.events: tuple[Event, ...] = module.EVENTS
        model_sync.land_previous(model)  # a trainer bound to it before: start from its updated weights
        tensors = self._bind_tensors(model)
        for name, t in tensors.items():  # NOTE: [Masters in the schedule's dtype] in optim.py
            if module.PLACEHOLDERS[name][0] == "param" and t.dtype != master_dtype(module, t.dtype):
                t.data = t.data.to(master_dtype(module, t.dtype))
        self.device = torch.device(device) if device is not None else next(iter(tensors.values())).device
        self._check_device()
        self.device = indexed(self.device)
        self.cuda = self.device.type == "cuda"
        self.dp = DataParallel.for_schedule(module, process_group, self.device)  # NOTE: [Data parallel]
        if self.cuda and cap_memory:  # NOTE: [Memory cap]
            total = torch.cuda.get_device_properties(self.device).total_memory
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            torch.cuda.set_per_process_memory_fraction(min(1.0, max(module.BUDGET - CAP_MARGIN, CAP_FLOOR) / total), index)
        self.sharded = self.dp is not None and getattr(module, "SHARDED", False)  # NOTE: [Sharded state] in sharding.py
        layouts, pieces = (self._shard(tensors) if self.sharded else (None, None))
        self.pinned = PinnedArena(self.cuda)  # NOTE: [Pinned arena] in pinned.py
        if self.cuda:
            self._pin_streamed_masters(tensors)
            if not self.sharded:
                self._place_resident_masters(tensors)
        # NOTE: [Masters on disk] in solver/disk_model.py: in the file they were loaded into, or in a new one
        if disk_masters is None and masters_on_disk(module):
            disk_masters = DiskMasters(module, offload_dir)
        self.disk_masters = disk_masters
        self.store = ParamStore(module, tensors, self.device, self.pinned, layouts, pieces, disk_masters)
        self.pending_gather: set[int] = set()  # stages stepped whose new weights are not yet gathered
        self.gathered: set[int] = set()  # streamed stages gathered at this prefetch: their weights go back to the host
        self.streams = CudaStreams(self.device) if self.cuda else SerialStreams()
        self.max_grad_norm = max_grad_norm
        self.clipping = module.CLIPPING  # NOTE: [Gradient clipping] in stepping.py
        if max_grad_norm is not None and self.clipping == "off":
            raise ScheduleMismatch(
                f"max_grad_norm={max_grad_norm} asks for gradient clipping, but this schedule was compiled with "
                "--clipping off, which plans none: recompile with --clipping exact (or previous-norm), or bind "
                "without max_grad_norm")
        # NOTE: [Resident gradients freed at their step] in solver/footprint.py
        self.grads_freed = frozenset(s.index for s in self.stages if s.placement.step.frees_grads)
        self.issued: set[int] = set()  # stages whose device step was issued in the running step
        if serial_optimizer and (self.grads_freed or any(s.placement.kind == "backward" for s in self.stages)):
            raise ScheduleMismatch("serial_optimizer runs every optimizer step after backward, but this schedule steps "
                                   "some blocks inside it (NOTE: [Backward steps], [Resident gradients freed at their "
                                   "step]); bind without serial_optimizer")
        self.previous_norm_sq: torch.Tensor | None = None  # "previous-norm": the last step's squared global norm
        self.serial_optimizer = serial_optimizer  # the baseline: every optimizer step after backward, waited for
        chosen = getattr(module, "OPTIMIZER_STATES", "32bit")
        groups = []
        for names, states in [(s.params, s.states) for s in self.stages] + [(module.SHARED, chosen)]:
            group = {"params": [self.store.home[p] for p in names], "states": states}
            if self.sharded:  # the pieces' places in their parameters: the bf16 rounding noise follows them
                group["offsets"] = [self.store.offset(p) for p in names]
            if fused is not None or self.cuda:
                group["fused"] = fused if fused is not None else True
            groups.append(group)
        self.optimizer = staged_optimizer(chosen, groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                          foreach=foreach)
        # NOTE: [Disk-resident states] and [Disk-stepped stages] in solver/disk_model.py: under
        # `offload_dir` (default: the temp directory); NOTE: [Backward steps from disk] there: through a ring
        on_disk = {s.index: [self.store.home[p] for p in s.params] for s in self.stages if s.placement.step.states is Tier.DISK}
        in_backward = frozenset(s.index for s in self.stages if s.placement.kind == "backward")
        disk_stepped = {s: ps for s, ps in ((s.index, s.params) for s in self.stages if s.placement.step.states is Tier.DISK
                                            and s.placement.device_stepped) if s not in in_backward}
        self.disk_states = DiskStates(self.optimizer, on_disk, offload_dir or tempfile.gettempdir(), self.pinned,
                                      always_fresh=frozenset(disk_stepped), ahead=frozenset(disk_stepped),
                                      ring=frozenset(on_disk) & in_backward, masters=disk_masters,
                                      names={s.index: s.params for s in self.stages}) if on_disk else None
        if self.disk_states is not None:  # NOTE: [Masters on disk] in solver/disk_model.py
            self.store.staged = self.disk_states.staged
        # NOTE: [Activations on disk] in solver/disk_model.py: outputs through a ring of their own
        acts = [s for s in self.stages if s.placement.outputs is Outputs.DISK]
        acts_on_disk = {s.index for s in acts}
        reloads = [e.stage for e in self.events if e.kind is Kind.RELOAD and e.stage in acts_on_disk]
        self.act_disk = DiskActivations(acts, reloads, offload_dir or tempfile.gettempdir(), self.pinned) if acts else None
        self.host_grad: dict[str, torch.Tensor] = {}  # page-locked, in the compute dtype (D2H target)
        self.grad_buffers: dict[str, torch.Tensor] = {}  # gradients of host-stepped parameters, in the master's dtype
        self.fresh: set[str] = set()  # parameters whose host_grad holds a gradient not yet absorbed
        self.host_act: dict[str, torch.Tensor] = {}
        self.cpu_jobs: dict[int, Future] = {}  # stage -> its host optimizer step, still running
        self.stepper = GpuStepper(self.store, self.optimizer, {s.index: s.params for s in self.stages
                                                               if s.placement.device_stepped and s.index not in disk_stepped},
                                  self.host_grad, self.pinned, in_backward)
        # disk-stepped stages' jobs, one at a time in one GPU slot (the schedule's `dstep` buffer)
        self.disk_stepper = GpuStepper(self.store, self.optimizer, disk_stepped, self.host_grad, self.pinned)
        dstep = [b.bytes for b in module.BUFFERS if b.name == "dstep"] if disk_stepped else []
        slack = OPT_SLACK * 2  # one tensor's weights and optimizer slot at a time
        self.disk_step_slot = torch.empty(dstep[0] + slack, dtype=torch.uint8, device=self.device) if dstep else None
        self.record_timeline = False  # set True to time every event of each step
        self.timeline: list[tuple[int, float, float]] = []  # (event id, start s, end s) of the last step
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        if self.cuda:  # bind's copies ran on the default stream; compute has its own
            torch.cuda.synchronize(self.device)
        self._model_behind = False  # stepped since the last sync_model (NOTE: [Model sync hooks] in model_sync.py)
        if self.dp is not None:  # every rank bound the same schedule and weights; none steps before all have bound
            self.dp.check_agree(module.CHECKSUM, {module.PLACEHOLDERS[p][1]: t for p, t in self.store.master.items()})
        model_sync.attach(self, model)

    # ---- binding checks -----------------------------------------------------------------------
    def _bind_tensors(self, model) -> dict[str, torch.Tensor]:
        found = dict(model.named_parameters(remove_duplicate=False))  # tied weights answer to every name
        found.update(dict(model.named_buffers(remove_duplicate=False)))
        tensors: dict[str, torch.Tensor] = {}
        problems = []
        for name, (kind, target, shape, dtype) in self.m.PLACEHOLDERS.items():
            if kind == "input":
                continue
            t = found.get(target)
            if t is None:
                problems.append(f"it has no {kind} {target}")
            elif tuple(t.shape) != tuple(shape):
                problems.append(f"{target} is {_fmt(t.shape, t.dtype)}, compiled for {_fmt(shape, dtype)}")
            elif t.device.type == "meta":
                problems.append(f"{target} is on the meta device; load or initialise the weights first")
            else:
                tensors[name] = t
        known = {target for kind, target, *_ in self.m.PLACEHOLDERS.values() if kind == "param"}
        known_ids = {id(found[t]) for t in known if t in found}
        extra = [n for n, p in model.named_parameters() if id(p) not in known_ids and p.requires_grad]
        if extra:
            problems.append(f"it has parameters the schedule does not know: {', '.join(extra[:3])}")
        if problems:
            raise ScheduleMismatch(
                f"schedule {self.m.SOURCE or '<in memory>'} (fingerprint {self.m.FINGERPRINT}) does not fit this model: "
                + "; ".join(problems[:4]) + ". Recompile the schedule for this model with `lazytrain compile`")
        return tensors

    def _check_device(self):
        """The stages run on the device type they were captured for (NOTE: [Capture on the target
        device] in ir/target.py): model code picks operators by device type."""
        file = getattr(self.m, "__file__", "") or ""
        name = f"schedule {file}" if file and not file.startswith("<") else "the schedule"
        where = (f"{name} (of {self.m.SOURCE or 'an in-memory model'}) was compiled for {self.m.DEVICE} "
                 f"(hardware {self.m.HARDWARE})")
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ScheduleMismatch(f"{where} and this machine has no usable GPU; recompile it with --hardware cpu to run here")
        if self.device.type != self.m.DEVICE:
            fix = "--hardware cpu" if self.device.type == "cpu" else "a hardware profile of this machine (`lazytrain profile`)"
            raise ScheduleMismatch(
                f"{where} and is bound on {self.device.type}: its operators were chosen for {self.m.DEVICE}. Recompile it with "
                f"{fix}, or bind it with device=\"{self.m.DEVICE}\"")

    def _shard(self, tensors) -> tuple[dict, dict]:
        """This rank's cut of every stage's parameters (NOTE: [Sharded state] in sharding.py), and
        the mixed-precision masters' pieces, taken before the model's parameters become the full
        weights in the compute dtype."""
        groups = [(s.index, s.params) for s in self.stages] + [(-1, self.m.SHARED)]
        # every stage has one, empty where all its parameters are shared (a prologue holding only a
        # tied embedding): its REDUCE and GATHER events then move nothing, on every rank alike
        layouts = {i: ShardLayout({p: tensors[p].numel() for p in names}, self.dp.world, self.dp.rank)
                   for i, names in groups}
        pieces = {}
        for lay in layouts.values():
            for p in lay.numel:
                t, dtype = tensors[p], getattr(torch, self.m.PLACEHOLDERS[p][3])
                if t.dtype != dtype:
                    pieces[p] = lay.own(p, t.detach()).clone()
                    t.data = t.data.to(dtype)
        return layouts, pieces

    def _pin_streamed_masters(self, tensors):
        """Page-locked masters copy to and from the GPU at full speed (pageable: ~9x slower). The
        parameter's storage moves into the arena: no second host copy."""
        for p in streamed_params(self.m) - set(masters_on_disk(self.m)):  # NOTE: [Masters on disk]: not those
            t = tensors[p]
            if t.device.type == "cpu" and not t.is_pinned():
                t.data = self.pinned.copy_of(t.data)

    def _place_resident_masters(self, tensors):
        """NOTE: [Resident masters on the device] in solver/step_model.py: a resident master moves
        to its home on the device, and the model's parameter with it; the host copy is freed."""
        streamed = streamed_params(self.m)
        for p, t in tensors.items():
            if self.m.PLACEHOLDERS[p][0] == "param" and p not in streamed and t.device != self.device:
                t.data = t.data.to(self.device)

    def _check_batch(self, batch: dict) -> dict:
        if set(batch) != set(self.m.BATCH):
            raise ScheduleMismatch(f"batch has inputs {sorted(batch)}, the schedule was compiled for {sorted(self.m.BATCH)}")
        for name, (shape, dtype) in self.m.BATCH.items():
            t = batch[name]
            if tuple(t.shape) != tuple(shape) or str(t.dtype).removeprefix("torch.") != dtype:
                raise ScheduleMismatch(
                    f"batch input {name} is {_fmt(t.shape, t.dtype)} but the schedule was compiled for "
                    f"{_fmt(shape, dtype)}; recompile with example_batch() returning that shape")
        return {k: v.to(self.device, non_blocking=True) for k, v in batch.items()}

    # ---- public API ---------------------------------------------------------------------------
    def forward_backward(self, batch: dict) -> torch.Tensor:
        """Loss of `batch`; gradients accumulate into the model's `.grad` as `loss.backward()` would."""
        return self._run(batch, optimize=False)

    def step(self, batch: dict) -> torch.Tensor:
        """One training step: fresh gradients, forward, backward, AdamW. Returns the loss.
        With exact clipping host steps may still run when it returns (NOTE: [Host step deadlines] in
        stepping.py), and GPU-stepped streamed stages apply their update
        at the next forward's prefetch; `synchronize()` (which `state_dict`, `sync_model` and
        `zero_grad` call) finishes both. The model's `state_dict()` and forward call `sync_model()`
        first (NOTE: [Model sync hooks] in model_sync.py)."""
        # Stages whose host step still runs clear their own gradients when done; waiting here
        # would serialise the host optimizer with this step's forward.
        self._clear_grads(s for s in range(-1, len(self.stages)) if s not in self.cpu_jobs)
        self._model_behind = True
        return self._run(batch, optimize=True)

    def zero_grad(self) -> None:
        self.synchronize()
        self._clear_grads(range(-1, len(self.stages)))

    def _clear_grads(self, stages) -> None:
        for s in stages:
            for p in self._names(s):
                self.store.master[p].grad = None
                self.store.home[p].grad = None
                self.store.work[p].grad = None

    def synchronize(self) -> None:
        """Finish every optimizer step: wait for host steps still running (with exact clipping they
        overlap the next step), and apply GPU steps of streamed stages still waiting for the next prefetch."""
        self._wait_host_steps()
        if self.cuda:  # every stream: what follows may read on any of them
            torch.cuda.synchronize(self.device)
        if self.disk_states is not None:  # the ring's writes after the last step's backward
            self.disk_states.drain()
        if self.stepper.pending:
            self._flush_gpu_steps()
        if self.pending_gather:  # NOTE: [Sharded state] in sharding.py: a collective
            self._land_gathers()

    def _flush_gpu_steps(self) -> None:
        """The pending updates' events, run back to back on the current stream (`synchronize`
        has waited for every stream first)."""
        for s in sorted(self.stepper.pending):
            self._fetch_stage(s, update=True)
            if self.stepper.step(s, self._group(s)) and self.sharded:
                self._gather_stage(s)
            self.stepper.write_weights(s)
            self.stepper.write_back(s)
            self._release_weights(s)
            self.store.release_slot(f"opt:{s}")
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def _land_gathers(self) -> None:
        """Host-stepped streamed stages' updates, gathered now instead of at their next prefetch."""
        for s in sorted(self.pending_gather):
            self._fetch_stage(s, update=False)
            self._gather_stage(s)
            self._write_gathered(s)
            self._release_weights(s)
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
        self._model_behind = False
