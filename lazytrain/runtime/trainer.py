"""The runtime: replay a schedule's events to run forward, backward and the optimizer.

On the CPU, events run one after another in schedule order, which is valid for every stream. On a
GPU they run on CUDA streams ordered by their waits (streams.py), so transfers overlap compute and
the CPU optimizer overlaps both. Each event touches only the buffers it names, so a wrong schedule
fails loudly instead of computing something else.

NOTE: [Streamed weights]
A streamed stage's parameters are persistent leaf tensors whose storage comes and goes: PREFETCH
points `leaf.data` at a weight slot and copies the weights in, FREE swaps in an empty tensor.
Autograd saved the leaf itself during forward, so backward (after the next PREFETCH) sees the same
leaf with its data back, and gradients accumulate on it, whatever the stage's recompute mode.
Swapping `.data` does not bump the version counter, so autograd accepts it.

NOTE: [Gradient clipping]
With `max_grad_norm`, each stage's squared gradient norm is added up right after its backward (no
extra pass over the gradients); optimizer steps, which need the global norm, wait until backward
ends, then run in forward order so the next step's forward can start on the first updated stages.
A non-finite norm skips the whole update and is counted in `skipped_steps`, as AMP's scaler does.

NOTE: [Optimizer stream]
Device optimizer steps (resident stages, shared weights, and GPU-stepped streamed stages) run on a
stream apart from compute, so their memory-bound kernels overlap compute instead of queueing on it.
That stream is the device's default stream and compute gets a stream of its own:
bitsandbytes launches its 8-bit kernels on the default stream whatever stream is current, so they
must be the optimizer's. Work outside events that touches compute's tensors (the batch's copy, the
gradient norm's read) runs in `streams.compute_context()`. Then:
  - a resident stage's step first waits for the compute issued so far (its gradients); a streamed
    stage's waits only for its prefetch (the schedule's waits), so it overlaps the compute before it;
  - the first compute that reads a stage's weights waits for that stage's step (shared weights:
    every compute until the shared step is done); the write-back copies wait on the step's event;
  - gradients a step reads are `record_stream`ed on that stream: the next step drops them while
    the step may still run.
Without clipping, resident steps overlap the rest of backward; with it, they overlap the next forward.

NOTE: [Memory cap]
The plan keeps the memory it allocates inside the budget, but PyTorch's caching allocator may
reserve more: freed blocks stay cached per stream and in the sizes first asked for. Measured on the
7B bench at 24 GiB: 16.7 GiB allocated at most, 66 GiB reserved. So on a GPU, `bind` caps the
process's allocator at the budget (`torch.cuda.set_per_process_memory_fraction`): past the cap the
allocator returns cached blocks to the device and retries before it fails. The cap is never below
`CAP_FLOOR`: there the allocator's own rounding (2 MiB pages, 20 MiB segments, per stream) would
dominate a tiny plan. `cap_memory=False` leaves the allocator alone (and any cap set before).

NOTE: [Chunked loss]
A stage with `chunks` = k > 1 (the last: final norm, lm_head, cross-entropy; pass `chunk`) runs its
forward and backward together at its BWD event, over k slices of the batch, so only one slice's
logits exist at a time. Slices are either k groups of whole rows (`chunk_len` 0: every cut tensor
splits along dim 0 into k), or pieces of `chunk_len` consecutive positions of one row, row by row
(`tokens` = (B, T)): a tensor whose leading dimensions are (B, T) is cut at [b, j*len:(j+1)*len],
a flattened one (leading B*T, row-major) at the same tokens, [b*T + j*len, ...). The stage's
inputs, the batch inputs it reads and the results of its whole part (`whole_fn`: nodes reading
batch inputs alone, such as Hugging Face's label shift, run once before the slices) are cut so.
The mean over the whole batch is not the mean of the chunks' means when ignored targets (-100) are
spread unevenly, so each chunk returns its loss as a *sum* with the *count* of targets it covers,
and backward runs on the sum. Sums and their gradients add up over chunks exactly; scaling both by
1 / (total count) at the end gives the mean and its gradient, as one unchunked call would (up to
float rounding). Gradients a parameter already held (tied weights, accumulation over calls) are
set aside meanwhile, so only this stage's part is scaled.
"""

from __future__ import annotations

import contextlib
import math
from concurrent.futures import Future
from types import ModuleType

import torch

from lazytrain.errors import ScheduleMismatch
from lazytrain.ir.events import Event, Kind, Phase, Stream
from lazytrain.runtime import model_sync
from lazytrain.runtime.gpu_step import GpuStepper
from lazytrain.runtime.optim import staged_optimizer
from lazytrain.runtime import rng
from lazytrain.runtime.pinned import PinnedArena
from lazytrain.runtime.store import ParamStore
from lazytrain.runtime.streams import CudaStreams, SerialStreams


CAP_FLOOR = 1 << 30  # NOTE: [Memory cap]


def _slices(stage, t: torch.Tensor) -> list[torch.Tensor]:
    """Views of `t` for each slice of a chunked stage, in order (NOTE: [Chunked loss])."""
    if not stage.chunk_len:
        return list(t.chunk(stage.chunks))
    rows, seq = stage.tokens
    n = stage.chunk_len
    if t.dim() >= 2 and tuple(t.shape[:2]) == (rows, seq):
        return [t[b:b + 1, j:j + n] for b in range(rows) for j in range(0, seq, n)]
    flat = t.unflatten(0, (rows, seq))  # leading B*T, row-major: splitting a dimension is a view
    return [flat[b, j:j + n] for b in range(rows) for j in range(0, seq, n)]


def _fmt(shape, dtype) -> str:
    return f"{str(dtype).removeprefix('torch.')}{list(shape)}"


class Trainer:
    """`schedule.bind(model, lr=...)` returns one. `forward_backward(batch)` leaves each parameter's
    gradient in `.grad`; `step(batch)` also applies AdamW. `optimizer` is a `torch.optim.Optimizer`
    (LR schedulers attach to it), and `state_dict()` / `load_state_dict()` save and restore it.
    `device` (default: where the model is) is where compute runs; the model's own parameters stay
    the masters (fp32; bf16 if compiled with `--master-weights bf16`). On a GPU the process's
    allocator is capped at the budget unless `cap_memory=False` (NOTE: [Memory cap])."""

    def __init__(self, module: ModuleType, model: torch.nn.Module, *, lr=1e-3, betas=(0.9, 0.999), eps=1e-8,
                 weight_decay=0.01, max_grad_norm: float | None = None, device=None, foreach=None, fused=None,
                 serial_optimizer: bool = False, cap_memory: bool = True):
        self.m = module
        self.model = model
        self.stages = module.STAGES
        self.events: tuple[Event, ...] = module.EVENTS
        model_sync.land_previous(model)  # a trainer bound to it before: start from its updated weights
        tensors = self._bind_tensors(model)
        if getattr(module, "MASTER_WEIGHTS", "fp32") == "bf16":  # NOTE: [bf16 master weights] in optim.py
            for name, t in tensors.items():
                if module.PLACEHOLDERS[name][0] == "param" and t.is_floating_point():
                    t.data = t.data.to(torch.bfloat16)
        self.device = torch.device(device) if device is not None else next(iter(tensors.values())).device
        self._check_device()
        self.cuda = self.device.type == "cuda"
        if self.cuda and cap_memory:  # NOTE: [Memory cap]
            total = torch.cuda.get_device_properties(self.device).total_memory
            index = self.device.index if self.device.index is not None else torch.cuda.current_device()
            torch.cuda.set_per_process_memory_fraction(min(1.0, max(module.BUDGET, CAP_FLOOR) / total), index)
        self.pinned = PinnedArena(self.cuda)  # NOTE: [Pinned arena]
        if self.cuda:
            self._pin_streamed_masters(tensors)
        self.store = ParamStore(module, tensors, self.device, self.pinned)
        self.streams = CudaStreams(self.device) if self.cuda else SerialStreams()
        self.max_grad_norm = max_grad_norm
        self.serial_optimizer = serial_optimizer  # the baseline: every optimizer step after backward, waited for
        chosen = getattr(module, "OPTIMIZER_STATES", "32bit")
        groups = []
        for names, states in [(s.params, s.states) for s in self.stages] + [(module.SHARED, chosen)]:
            group = {"params": [self.store.home[p] for p in names], "states": states}
            if fused is not None or self.cuda:
                group["fused"] = fused if fused is not None else True
            groups.append(group)
        self.optimizer = staged_optimizer(chosen, groups, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay,
                                          foreach=foreach)
        self.host_grad: dict[str, torch.Tensor] = {}  # page-locked, in the compute dtype (D2H target)
        self.grad_buffers: dict[str, torch.Tensor] = {}  # gradients of host-stepped parameters, in the master's dtype
        self.fresh: set[str] = set()  # parameters whose host_grad holds a gradient not yet absorbed
        self.host_act: dict[str, torch.Tensor] = {}
        self.cpu_jobs: dict[int, Future] = {}  # stage -> its host optimizer step, still running
        self.stepper = GpuStepper(self.store, self.optimizer,
                                  {s.index: s.params for s in self.stages if s.gpu_step}, self.host_grad, self.pinned)
        self.record_timeline = False  # set True to time every event of each step
        self.timeline: list[tuple[int, float, float]] = []  # (event id, start s, end s) of the last step
        self.skipped_steps = 0
        self.last_grad_norm: float | None = None
        if self.cuda:  # bind's copies ran on the default stream; compute has its own
            torch.cuda.synchronize(self.device)
        self._model_behind = False  # stepped since the last sync_model (NOTE: [Model sync hooks])
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
        where = f"schedule {self.m.SOURCE or '<in memory>'} was compiled for {self.m.DEVICE} (hardware {self.m.HARDWARE})"
        if self.device.type == "cuda" and not torch.cuda.is_available():
            raise ScheduleMismatch(f"{where} and this machine has no usable GPU; recompile it with --hardware cpu to run here")
        if self.device.type != self.m.DEVICE:
            fix = "--hardware cpu" if self.device.type == "cpu" else "a hardware profile of this machine (`lazytrain profile`)"
            raise ScheduleMismatch(
                f"{where} and is bound on {self.device.type}: its operators were chosen for {self.m.DEVICE}. Recompile it with "
                f"{fix}, or bind it with device=\"{self.m.DEVICE}\"")

    def _pin_streamed_masters(self, tensors):
        """Page-locked masters copy to and from the GPU at full speed (pageable: ~9x slower). The
        parameter's storage moves into the arena: no second host copy."""
        streamed = {p for s in self.stages if s.stream for p in s.params}
        for p in streamed:
            t = tensors[p]
            if t.device.type == "cpu" and not t.is_pinned():
                t.data = self.pinned.copy_of(t.data)

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
        Host steps may still run when it returns, and GPU-stepped streamed stages apply their update
        at the next forward's prefetch; `synchronize()` (which `state_dict`, `sync_model` and
        `zero_grad` call) finishes both. The model's `state_dict()` and forward call `sync_model()`
        first (NOTE: [Model sync hooks])."""
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
        """Finish every optimizer step: wait for host steps still running (they overlap the next
        step), and apply GPU steps of streamed stages still waiting for the next prefetch."""
        for job in self.cpu_jobs.values():
            job.result()
        self.cpu_jobs.clear()
        if self.cuda:  # every stream: what follows may read on any of them
            torch.cuda.synchronize(self.device)
        if self.stepper.pending:
            self._flush_gpu_steps()

    def _flush_gpu_steps(self) -> None:
        """The pending updates' events, run back to back on the current stream (`synchronize`
        has waited for every stream first)."""
        for s in sorted(self.stepper.pending):
            self._fetch_stage(s, update=True)
            self.stepper.step(s, self._group(s))
            self.stepper.write_weights(s)
            self.stepper.write_back(s)
            self._release_weights(s)
            self.store.release_slot(f"opt:{s}")
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def state_dict(self) -> dict:
        self.synchronize()
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
                if home is not master:
                    master.copy_(home)
        self._model_behind = False

    # ---- replay -------------------------------------------------------------------------------
    def _run(self, batch: dict, optimize: bool) -> torch.Tensor:
        with self.streams.compute_context():  # NOTE: [Optimizer stream]
            self.env = dict(self._check_batch(batch))  # placeholder/activation name -> tensor
        self.env.update(self.store.buffers)
        self.grads: dict[str, torch.Tensor] = {}
        self.saved: dict[int, tuple] = {}
        self.rng: dict[int, rng.RngState] = {}  # random stage -> generator states its forward began from
        self.gbuf: dict[int, dict[str, torch.Tensor]] = {}
        self.loss = None
        self.norm_sq = None
        handlers = {
            Kind.PREFETCH: self._prefetch, Kind.COMPUTE: self._compute, Kind.OFFLOAD: self._offload,
            Kind.RELOAD: self._reload, Kind.FREE: self._free,
        }
        deferred = []
        self.streams.begin(self.record_timeline)
        for event in self.events:
            if event.kind is Kind.OPT_STEP and event.stage >= 0 and self.stages[event.stage].gpu_step:
                # last step's update of a GPU-stepped streamed stage, at its prefetch
                self.streams.run_aside(event, lambda s=event.stage: self.stepper.step(s, self._group(s)),
                                       after_compute=False)
                continue
            if event.kind is Kind.OPT_STEP:
                if optimize and self.max_grad_norm is None and not self.serial_optimizer:
                    self._opt_step(event, 1.0)
                elif optimize:
                    deferred.append(event)
                continue
            if event.kind is Kind.COMPUTE:  # its weights must be stepped (NOTE: [Optimizer stream])
                self.streams.wait_aside(event.stage)
                self.streams.wait_aside(-1)  # shared (tied) weights
            self.streams.run(event, lambda e=event: handlers[e.kind](e))
        if optimize and (deferred or self.stepper.params):
            with self.streams.compute_context():
                coef = self._clip_coefficient() if self.max_grad_norm is not None else 1.0
            if coef is None:
                self.skipped_steps += 1
                self.fresh.clear()
                self.zero_grad()
            else:
                for event in sorted(deferred, key=lambda e: (e.stage < 0, e.stage)):
                    self._opt_step(event, coef)
                self._record_gpu_steps(coef)
                if self.serial_optimizer:
                    self.synchronize()
        timeline = self.streams.finish()
        if not optimize:
            self._absorb_grads(all_stages=True)
        self.timeline = timeline or []
        loss, self.loss = self.loss, None
        self.env = self.grads = self.saved = self.gbuf = self.rng = None
        return loss

    def _weight(self, name):
        work = self.store.work.get(name)
        return work if work is not None else self.env[name]

    def _call(self, stage, grad: bool, remat: bool = False, again: bool = False):
        """Run a stage's forward. With `grad`, inputs become fresh leaves and autograd records; with
        `remat`, the values no backward reads are left uncomputed (NOTE: [Skipped recompute]); with
        `again` (a recompute), a random stage draws what its forward drew (NOTE: [RNG replay])."""
        draws = contextlib.nullcontext()
        if stage.random and again:
            draws = rng.replay(self.rng[stage.index], self.device)
        elif stage.random:
            self.rng[stage.index] = rng.record(self.device)
        if grad:
            leaves = {x: self.env[x].detach().requires_grad_(x in stage.grad_inputs) for x in stage.inputs}
            args = [self._weight(p) for p in stage.placeholders] + [leaves[x] for x in stage.inputs]
            with torch.enable_grad(), draws:
                outs = stage.fn(self.device, *args, **({"remat": True} if remat and stage.skips else {}))
            return leaves, outs
        args = [self._weight(p) for p in stage.placeholders] + [self.env[x] for x in stage.inputs]
        with torch.no_grad(), draws:
            return None, stage.fn(self.device, *args)

    def _publish(self, stage, outs):
        for name, t in zip(stage.outputs, outs):
            if name == self.m.LOSS:
                self.loss = t.detach()
            else:
                self.env[name] = t.detach()

    def _compute(self, e: Event):
        stage = self.stages[e.stage]
        if e.phase is Phase.FWD:
            if stage.chunks > 1:  # its loss comes out of its backward (NOTE: [Chunked loss])
                return
            leaves, outs = self._call(stage, grad=not stage.recompute)
            if not stage.recompute:
                self.saved[e.stage] = (leaves, outs)
            self._publish(stage, outs)
        elif e.phase is Phase.RECOMPUTE:
            self._publish(stage, self._call(stage, grad=False, again=True)[1])
        elif stage.chunks > 1:
            self._chunked_backward(stage)
        else:
            self._backward(stage)

    def _backward(self, stage):
        leaves, outs = self.saved.pop(stage.index) if not stage.recompute else self._call(
            stage, grad=True, remat=True, again=True)
        tensors, grads = [], []
        for name, t in zip(stage.outputs, outs):
            g = torch.ones_like(t) if name == self.m.LOSS else self.grads.get(name)
            if g is not None and t.requires_grad:
                tensors.append(t)
                grads.append(g)
        if tensors:
            torch.autograd.backward(tensors, grads)
        for x in stage.grad_inputs:
            g = leaves[x].grad
            if g is not None:
                self.grads[x] = g if x not in self.grads else self.grads[x] + g
        self._grads_done(stage)

    def _chunked_backward(self, stage):
        """Forward and backward of a chunked stage, slice by slice of the batch (NOTE: [Chunked loss])."""
        work = self.store.work
        params = [p for p in stage.placeholders if p in work]  # shared (tied) ones too
        held = {p: work[p].grad for p in params}
        for p in params:
            work[p].grad = None
        whole = {}
        if stage.whole_fn is not None:
            with torch.no_grad():
                outs = stage.whole_fn(self.device, *[self._weight(p) for p in stage.placeholders])
            whole = dict(zip(stage.whole_outputs, outs))
        cut = {x: _slices(stage, self.env[x]) for x in stage.inputs}  # activations and batch inputs: views
        cut.update({p: _slices(stage, self.env[p]) for p in stage.placeholders if self.m.PLACEHOLDERS[p][0] == "input"})
        cut.update({n: _slices(stage, t) for n, t in whole.items()})
        grads = {x: torch.zeros_like(self.env[x]) for x in stage.grad_inputs}
        grad_slices = {x: _slices(stage, g) for x, g in grads.items()}
        loss_sum = count = 0
        for c in range(stage.chunks):
            leaves = [cut[x][c].detach().requires_grad_(x in stage.grad_inputs) for x in stage.inputs]
            args = [cut[p][c] if p in cut else self._weight(p) for p in stage.placeholders] + leaves
            with torch.enable_grad():
                part, n = stage.fn(self.device, *args, *(cut[w][c] for w in stage.whole_outputs), loss_sum=True)
            if part.requires_grad:
                part.backward()
            for x, leaf in zip(stage.inputs, leaves):
                if x in grads and leaf.grad is not None:
                    grad_slices[x][c].copy_(leaf.grad)
            loss_sum, count = loss_sum + part.detach().float(), count + n  # fp32: k partial sums
        scale = 1.0 / count
        for x, g in grads.items():
            g.mul_(scale)
            self.grads[x] = g if x not in self.grads else self.grads[x] + g
        for p in params:
            g = work[p].grad
            if g is not None:
                g.mul_(scale)
            if held[p] is not None:
                work[p].grad = held[p] if g is None else held[p].add_(g)
        self._publish(stage, ((loss_sum / count).to(part.dtype),))
        self._grads_done(stage)

    def _grads_done(self, stage):
        """After a stage's backward: park streamed gradients for their offload; add to the norm."""
        work = self.store.work
        if stage.stream:  # gradients of streamed weights wait in g:S for their offload
            self.gbuf[stage.index] = {p: work[p].grad for p in stage.params}
            for p in stage.params:
                work[p].grad = None
        if self.max_grad_norm is not None:
            names = stage.params + (self.m.SHARED if stage.index == 0 else ())
            done = [g for g in (self.gbuf[stage.index].values() if stage.stream else ()) if g is not None]
            done += [work[p].grad for p in names if not stage.stream or p in self.m.SHARED if work[p].grad is not None]
            self._add_norm(done)

    def _add_norm(self, grads):
        if grads:
            sq = torch.stack(torch._foreach_norm(grads)).float().pow(2).sum()
            self.norm_sq = sq if self.norm_sq is None else self.norm_sq + sq

    def _clip_coefficient(self) -> float | None:
        """torch.nn.utils.clip_grad_norm_'s coefficient, or None when the norm is not finite."""
        norm = math.sqrt(self.norm_sq.item()) if self.norm_sq is not None else 0.0
        self.last_grad_norm = norm
        if not math.isfinite(norm):
            return None
        return min(1.0, self.max_grad_norm / (norm + 1e-6))

    def _prefetch(self, e: Event):
        job = self.cpu_jobs.pop(e.stage, None)
        if job is not None:  # the previous step's host optimizer must finish updating the source
            job.result()
        self._fetch_stage(e.stage, update=e.allocs[0].startswith("opt:") and e.stage in self.stepper.pending)

    def _fetch_stage(self, stage: int, update: bool):
        """A weight slot for `stage`; the weights copied in, or with a pending GPU step its master,
        states and gradient into an optimizer slot (the step writes the weights)."""
        self._take_slot(f"w:{stage}")
        if update:
            self.stepper.fetch(stage, self._take_slot(f"opt:{stage}"))
        with torch.no_grad():
            for p in self.stages[stage].params:
                view = self.store.slot_view(stage, p)
                if not update:
                    view.copy_(self.store.source[p], non_blocking=True)
                self.store.work[p].data = view

    def _offload(self, e: Event):
        buf = e.reads[0]
        if buf.startswith("w:"):
            self.stepper.write_weights(e.stage)
        elif buf.startswith("opt:"):
            self.stepper.write_back(e.stage)
        elif buf.startswith("g:"):  # gradients of streamed weights go to page-locked host buffers
            for name, g in self.gbuf[e.stage].items():
                if g is None:
                    continue
                host = self.host_grad.get(name)
                if host is None or host.shape != g.shape:
                    host = self.host_grad[name] = self.pinned.empty(g.shape, g.dtype)
                host.copy_(g, non_blocking=True)
                self.fresh.add(name)
        else:
            for name in self.stages[e.stage].outputs:
                if name in self.env:
                    t = self.env[name]
                    host = self.host_act.get(name)
                    if host is None:
                        host = self.host_act[name] = self.pinned.empty(t.shape, t.dtype)
                    host.copy_(t, non_blocking=True)

    def _reload(self, e: Event):
        for name in self.stages[e.stage].outputs:
            if name in self.host_act:
                t = self.host_act[name].to(self.device, non_blocking=True)
                if self.cuda:
                    t.record_stream(self.streams.stream(Stream.COMPUTE))
                self.env[name] = t

    def _free(self, e: Event):
        kind, _, idx = e.frees[0].partition(":")
        if kind == "host":  # host buffers are kept for the next step
            return
        stage = self.stages[int(idx)]
        if kind == "w":
            self._release_weights(stage.index)
        elif kind == "opt":
            if e.frees[0] in self.store.slots:
                self.store.release_slot(e.frees[0])
        elif kind == "g":
            self.gbuf.pop(stage.index, None)
        elif kind == "act":
            for name in stage.outputs:
                self.env.pop(name, None)
        elif kind == "saved":
            self.saved.pop(stage.index, None)
        elif kind == "grad":
            for name in stage.outputs:
                self.grads.pop(name, None)

    def _take_slot(self, name: str) -> torch.Tensor:
        return self.store.take_slot(name, lambda n: self.streams.slot(n, self.device))

    def _release_weights(self, stage: int) -> None:
        for p in self.stages[stage].params:
            self.store.work[p].data = torch.empty(0, device=self.device, dtype=self.store.dtype[p])
        self.store.release_slot(f"w:{stage}")

    # ---- optimizer ------------------------------------------------------------------------------
    def _record_gpu_steps(self, coef: float) -> None:
        """GPU-stepped streamed stages: their gradients wait on the host for the next prefetch."""
        for s, names in self.stepper.params.items():
            if any(p in self.fresh for p in names):
                self.stepper.record(s, self.optimizer.hyperparameters(s), coef)
                self.fresh.difference_update(names)

    def _names(self, stage: int) -> tuple[str, ...]:
        return self.stages[stage].params if stage >= 0 else self.m.SHARED

    def _group(self, stage: int) -> int:
        return stage if stage >= 0 else len(self.stages)

    def _absorb_grads(self, all_stages: bool = False, stage: int | None = None):
        """Accumulate gradients held elsewhere (host buffers, device work copies) into the homes'
        (and, without a step, the model's) `.grad`."""
        stages = range(-1, len(self.stages)) if all_stages else [stage]
        for s in stages:
            for p in self._names(s):
                streamed = s >= 0 and self.stages[s].stream
                if streamed:  # page-locked buffers stay (allocating them is slow); the mark is consumed
                    src = self.host_grad[p] if p in self.fresh else None
                    self.fresh.discard(p)
                else:
                    src = self.store.work[p].grad
                target = self.store.master[p] if all_stages else self.store.home[p]
                if src is None or (not streamed and target is self.store.work[p]):
                    continue
                if target.grad is None and streamed and not all_stages:  # a step: reuse a buffer
                    buf = self.grad_buffers.get(p)
                    if buf is None:
                        buf = self.grad_buffers[p] = torch.empty(src.shape, dtype=target.dtype, device=target.device)
                    target.grad = buf.copy_(src)
                    continue
                g = src.to(target.device, target.dtype, copy=True)
                target.grad = g if target.grad is None else target.grad + g
                if not streamed:
                    self.store.work[p].grad = None

    def _opt_step(self, e: Event, coef: float):
        s = e.stage
        names = self._names(s)
        hyper = self.optimizer.hyperparameters(self._group(s))  # a later LR scheduler step must not reach it

        def step():
            self._absorb_grads(stage=s)
            if coef != 1.0:
                for p in names:
                    if self.store.home[p].grad is not None:
                        self.store.home[p].grad.mul_(coef)
            self.optimizer.step_group(self._group(s), hyper)

        if e.device == "cpu":
            def host_step():
                step()
                self.store.refresh_source(names)
                for p in names:  # consumed: the next step starts from fresh gradients
                    self.store.home[p].grad = None
            self.cpu_jobs[s] = self.streams.host(e, host_step)
        else:
            def device_step():
                grads = [t.grad for p in names for t in (self.store.work[p], self.store.home[p]) if t.grad is not None]
                step()
                self.store.refresh_work(names)
                if self.cuda:  # the next step drops these gradients while this stream may still read them
                    for g in grads:
                        g.record_stream(torch.cuda.current_stream())
            self.streams.run_aside(e, device_step, after_compute=True)
