"""Replaying a schedule's events: forward, backward, recompute, prefetch, offload, reload, free.

The `Trainer`'s event handlers (a mixin): each touches only the buffers its event names, so a wrong
schedule fails loudly instead of computing something else.

NOTE: [Streamed weights]
A streamed stage's parameters are persistent leaf tensors whose storage comes and goes: PREFETCH
points `leaf.data` at a weight slot and copies the weights in, FREE swaps in an empty tensor.
Autograd saved the leaf itself during forward, so backward (after the next PREFETCH) sees the same
leaf with its data back, and gradients accumulate on it, whatever the stage's recompute mode.
Swapping `.data` does not bump the version counter, so autograd accepts it.

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
float rounding); on several ranks, by N / (the ranks' total count), NOTE: [Data parallel]. Gradients
a parameter already held (tied weights, accumulation over calls) are set aside meanwhile, so only
this stage's part is scaled.
"""

from __future__ import annotations

import contextlib

import torch

from lazytrain.ir.events import Event, Kind, Phase, Stream
from lazytrain.ir.placement import Outputs
from lazytrain.runtime import rng


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




class Replay:
    """Runs one step's events (`_run`) for `Trainer`, whose state it reads: the schedule, the
    parameter store, the streams and the optimizer (stepping.py)."""

    def _run(self, batch: dict, optimize: bool) -> torch.Tensor:
        with self.streams.compute_context():  # NOTE: [Optimizer stream] in stepping.py
            self.env = dict(self._check_batch(batch))  # placeholder/activation name -> tensor
        self.env.update(self.store.buffers)
        self.grads: dict[str, torch.Tensor] = {}
        self.saved: dict[int, tuple] = {}
        self.rng: dict[int, rng.RngState] = {}  # random stage -> generator states its forward began from
        self.gbuf: dict[int, dict[str, torch.Tensor]] = {}
        self.loss = None
        self.loss_scale = None  # with ranks: world / their learnt targets, once per step (NOTE: [Data parallel])
        self.norm_sq = None
        handlers = {
            Kind.PREFETCH: self._prefetch, Kind.COMPUTE: self._compute, Kind.OFFLOAD: self._offload,
            Kind.RELOAD: self._reload, Kind.FREE: self._free, Kind.REDUCE: self._reduce, Kind.GATHER: self._gather,
        }
        self.sharding = self.sharded and optimize  # NOTE: [Sharded state] in sharding.py
        if self.act_disk is not None:  # NOTE: [Activations on disk] in solver/disk_model.py
            self.act_disk.begin()
        deferred, gathers = [], {}
        coef = self._early_coefficient() if optimize and not self.serial_optimizer else None  # None: steps wait
        # NOTE: [Backward steps], [Resident gradients freed at their step]: they cannot wait for this step's norm
        if optimize and (self.stepper.backward or self.grads_freed):
            coef = 1.0 if coef is None else coef  # previous-norm's first step: none to clip by yet
            self._record_backward_steps(coef)
            if self.ring is not None:  # NOTE: [Backward steps from disk]: their states read in backward's order
                self.ring.read(sorted(self.ring.stages, reverse=True))
        self.issued: set[int] = set()  # stages whose device step was issued in this step
        self.streams.begin(self.record_timeline)
        for event in self.events:
            if event.kind is Kind.OPT_STEP and event.stage in self.stepper.backward:  # NOTE: [Backward steps]
                self.streams.run_aside(event, lambda s=event.stage: self._backward_step(s, optimize), after_compute=True)
                continue
            if event.kind is Kind.OPT_STEP and event.stage >= 0 and event.device == "gpu" and self.stages[event.stage].placement.device_stepped:
                # last step's update of a GPU-stepped streamed stage, at its prefetch
                self.streams.run_aside(event, lambda s=event.stage: self._gpu_step(s), after_compute=False)
                continue
            if event.kind is Kind.OPT_STEP:
                if coef is not None:
                    self._opt_step(event, coef)
                elif optimize:
                    deferred.append(event)
                continue
            if event.kind is Kind.GATHER and any(d.stage == event.stage for d in deferred):
                gathers[event.stage] = event  # after its deferred step
                continue
            if event.kind is Kind.COMPUTE:  # its weights must be stepped (NOTE: [Optimizer stream] in stepping.py)
                self.streams.wait_aside(event.stage)
                self.streams.wait_aside(-1)  # shared (tied) weights
            self.streams.run(event, lambda e=event: handlers[e.kind](e))
        if optimize and self.max_grad_norm is not None:  # this step's global norm: its clipping, or the next's
            with self.streams.compute_context():
                waited = coef is None
                if waited:
                    coef = self._clip_coefficient()  # leaves the global norm in norm_sq
                if self.clipping == "previous-norm" and coef is not None:  # the next step clips by it
                    self.previous_norm_sq = self.norm_sq if waited else self._global_norm_sq()
        elif optimize:
            coef = 1.0
        if optimize and (deferred or self.stepper.params):
            if coef is None:
                self.skipped_steps += 1
                self.fresh.clear()
                self.zero_grad()
            else:
                for event in sorted(deferred, key=lambda e: (e.stage < 0, e.stage)):
                    self._opt_step(event, coef)
                    if event.stage in gathers:
                        g = gathers[event.stage]
                        self.streams.run(g, lambda g=g: self._gather(g))
                self._record_gpu_steps(coef)
                if self.serial_optimizer:
                    self.synchronize()
        if optimize and not deferred:  # host steps end inside their step (NOTE: [Host step deadlines])
            self._wait_host_steps(disk_jobs=False)
        timeline = self.streams.finish()
        if self.dp is not None and self.loss is not None:  # the global batch's loss (NOTE: [Data parallel])
            self.loss = self.dp.mean_loss(self.loss)
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
            if stage.chunks > 1:  # its loss comes out of its backward (NOTE: [Chunked loss])
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
        scale = 1.0 / count if self.dp is None else self.dp.loss_scale(count)  # NOTE: [Data parallel]
        for x, g in grads.items():
            g.mul_(scale)
            self.grads[x] = g if x not in self.grads else self.grads[x] + g
        for p in params:
            g = work[p].grad
            if g is not None:
                g.mul_(scale)
            if held[p] is not None:
                work[p].grad = held[p] if g is None else held[p].add_(g)
        self._publish(stage, ((loss_sum / count if self.dp is None else loss_sum * scale).to(part.dtype),))
        self._grads_done(stage)

    def _grads_done(self, stage):
        """After a stage's backward: average its gradients over data-parallel ranks; park streamed
        gradients for their offload; add to the norm."""
        work = self.store.work
        if self.sharding:  # its REDUCE event reduce-scatters them (NOTE: [Sharded state] in sharding.py)
            return
        if self.dp is not None:  # before anything reads them (NOTE: [Data parallel] in data_parallel.py)
            names = stage.params + (self.m.SHARED if stage.index == 0 else ())
            self.dp.reduce_grads(stage.index, [work[p].grad for p in names if work[p].grad is not None])
        if stage.placement.streamed:  # gradients of streamed weights wait in g:S for their offload
            self.gbuf[stage.index] = {p: work[p].grad for p in stage.params}
            for p in stage.params:
                work[p].grad = None
        if self.max_grad_norm is not None:
            names = stage.params + (self.m.SHARED if stage.index == 0 else ())
            done = [g for g in (self.gbuf[stage.index].values() if stage.placement.streamed else ()) if g is not None]
            done += [work[p].grad for p in names if not stage.placement.streamed or p in self.m.SHARED if work[p].grad is not None]
            self._add_norm(done)

    def _reduce(self, e: Event):
        """This rank's shard of the stage's averaged gradients; the full ones go (NOTE: [Sharded
        state] in sharding.py). Without a step (`forward_backward`) the backward all-reduced them."""
        if not self.sharding:
            return
        s, work = e.stage, self.store.work
        names = self._names(s)
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
            self.gbuf[s] = shards
            if self.cuda:  # made on the comm stream's pool, read by the copy: not reused before it is done
                for g in shards.values():
                    if g is not None:
                        g.record_stream(self.streams.stream(Stream.D2H))
        else:
            for p, g in shards.items():
                home = self.store.home[p]
                home.grad = None if g is None else g if g.dtype == home.dtype else g.to(home.dtype)
        if self.max_grad_norm is not None:
            self._add_norm([g for g in shards.values() if g is not None])

    def _gather(self, e: Event):
        """A stepped stage's new weights from every rank's piece (NOTE: [Sharded state])."""
        if e.stage not in self.pending_gather:
            return
        self._gather_stage(e.stage)
        if e.stage >= 0 and self.stages[e.stage].placement.streamed and e.stage not in self.stepper.params:
            self.gathered.add(e.stage)  # its OFFLOAD w:S takes them to the host
        self.streams.stepped_at(e.stage)  # the next compute that reads them waits for this

    def _gather_stage(self, s: int) -> None:
        self.pending_gather.discard(s)
        targets = {p: self.store.work[p].data for p in self._names(s)}
        pieces = {p: self.store.mine(p, t) for p, t in targets.items()}
        self.dp.all_gather(s, self.store.layouts[s], pieces, targets)

    def _write_gathered(self, s: int) -> None:
        """A host-stepped streamed stage's gathered weights to the host copy prefetches read."""
        self.gathered.discard(s)
        for p in self.stages[s].params:
            self.store.source[p].copy_(self.store.work[p].data, non_blocking=True)

    def _backward_step(self, s: int, optimize: bool) -> None:
        """A stage stepped right after its backward, on the gradients there; without a step
        (`forward_backward`) they go to the host for `.grad` instead (NOTE: [Backward steps])."""
        grads = self.gbuf.get(s, {})
        if optimize:
            self.stepper.step(s, self._group(s), grads=grads)
            return
        for name, g in grads.items():
            if g is not None:
                self.host_grad[name] = g.to("cpu", copy=True)
                self.fresh.add(name)

    def _gpu_step(self, s: int) -> None:
        if self.stepper.step(s, self._group(s)) and self.sharded:
            self.pending_gather.add(s)

    def _prefetch(self, e: Event):
        if self.stages[e.stage].placement.weights.cast_on_use:
            self._cast_weights(e.stage)
            return
        job = self.cpu_jobs.pop(e.stage, None)
        if job is not None:  # the previous step's host optimizer must finish updating the source
            job.result()
        self._fetch_stage(e.stage, update=e.allocs[0].startswith("opt:") and e.stage in self.stepper.pending)

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

    def _fetch_stage(self, stage: int, update: bool):
        """A weight slot for `stage`; the weights copied in, or with a pending GPU step its master,
        states and gradient into an optimizer slot (the step writes the weights)."""
        self._take_slot(f"w:{stage}")
        if update:
            if self.ring is not None and stage in self.ring.stages:  # NOTE: [Backward steps from disk]
                self.ring.load(stage)
            self.stepper.fetch(stage, self._take_slot(f"opt:{stage}"))
        own = stage in self.pending_gather  # sharded: this rank's piece; the GATHER brings the rest
        stepped_here = update and stage not in self.stepper.backward  # else the weights come as they are
        with torch.no_grad():
            for p in self.stages[stage].params:
                view = self.store.slot_view(stage, p)
                if own and not stepped_here:
                    self.store.mine(p, view).copy_(self.store.mine(p, self.store.source[p]), non_blocking=True)
                elif p in self.store.from_master and not stepped_here:  # NOTE: [Weights from the master]
                    view.copy_(self.store.staging(stage, p).copy_(self.store.source[p], non_blocking=True))
                elif not stepped_here:
                    view.copy_(self.store.source[p], non_blocking=True)
                self.store.work[p].data = view

    def _offload(self, e: Event):
        buf = e.reads[0]
        if buf.startswith("w:") and e.stage in self.gathered:
            self._write_gathered(e.stage)
        elif buf.startswith("w:"):
            self.stepper.write_weights(e.stage)
        elif buf.startswith("opt:"):
            self.stepper.write_back(e.stage)
            if self.ring is not None and e.stage in self.ring.stages:  # NOTE: [Backward steps from disk]
                self.ring.store(e.stage, self._landed())
        elif buf.startswith(("g:", "sg:")):  # gradients of streamed weights (sharded: this rank's shard) to the host
            for name, g in self.gbuf[e.stage].items():
                if g is None:
                    continue
                host = self.host_grad.get(name)
                if host is None or host.shape != g.shape:
                    host = self.host_grad[name] = self.pinned.empty(g.shape, g.dtype)
                host.copy_(g, non_blocking=True)
                self.fresh.add(name)
        elif self.stages[e.stage].placement.outputs is Outputs.DISK:  # NOTE: [Activations on disk] in solver/disk_model.py
            outputs = {name: self.env[name] for name in self.stages[e.stage].outputs if name in self.env}
            self.act_disk.offload(e.stage, outputs, self._landed)
        else:
            for name in self.stages[e.stage].outputs:
                if name in self.env:
                    t = self.env[name]
                    host = self.host_act.get(name)
                    if host is None:
                        host = self.host_act[name] = self.pinned.empty(t.shape, t.dtype)
                    host.copy_(t, non_blocking=True)

    def _reload(self, e: Event):
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
        (where `.to` would return `host` itself)."""
        t = host.to(self.device, non_blocking=True, copy=copy)
        if self.cuda:
            t.record_stream(self.streams.stream(Stream.COMPUTE))
        return t

    def _free(self, e: Event):
        kind, _, idx = e.frees[0].partition(":")
        if kind == "rgrad":  # resident gradients: kept until the next step starts, unless the plan frees them
            self._free_resident_grads(e.frees)
            return
        if kind == "host":  # host buffers are kept for the next step
            return
        if kind == "sg":  # a streamed stage's gradient shard, offloaded; resident ones stay until the next step
            if idx.isdigit():
                self.gbuf.pop(int(idx), None)
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

    def _free_resident_grads(self, names) -> None:
        """NOTE: [Resident gradients freed at their step] in solver/footprint.py: the gradients of a
        stage whose step has been issued go now; the optimizer stream that reads them recorded its
        use, so their memory is reused only once the step is done."""
        for name in names:
            idx = name.partition(":")[2]
            if idx.isdigit() and int(idx) in self.grads_freed and int(idx) in self.issued:
                self._clear_grads([int(idx)])

    @property
    def ring(self):
        """The ring stages stepped in backward take their states through, if any."""
        return self.disk_states.ring if self.disk_states is not None else None

    def _landed(self):
        """An event after the work queued so far on the current stream (None on the CPU, where it is done)."""
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(self.device))
        return event

    def _take_slot(self, name: str) -> torch.Tensor:
        return self.store.take_slot(name, lambda n: self.streams.slot(n, self.device))

    def _release_weights(self, stage: int) -> None:
        for p in self.stages[stage].params:
            self.store.work[p].data = torch.empty(0, device=self.device, dtype=self.store.dtype[p])
        self.store.release_slot(f"w:{stage}")

