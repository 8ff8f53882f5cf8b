"""Gradients into the optimizer: the global norm, clipping, and each stage's AdamW step where
the schedule places it (the host CPU, the optimizer stream, or a GPU-stepped streamed stage's next
prefetch).

NOTE: [Gradient clipping]
With `max_grad_norm`, each stage's squared gradient norm is added up right after its backward (no
extra pass over the gradients). A schedule is compiled for one of three modes (`CLIPPING`):
  - "exact" (the default): optimizer steps, which need the global norm, wait until backward ends,
    then run in forward order so the next step's forward can start on the first updated stages.
    A non-finite norm skips the whole update and is counted in `skipped_steps`, as AMP's scaler does.
  - "previous-norm": every stage is clipped by the global norm of the step before, so its step runs
    during backward as an unclipped one does. The first step has no previous norm and runs exact;
    in a schedule that steps blocks right after their backward (NOTE: [Backward steps] in
    solver/step_model.py) it is not clipped, since those steps cannot wait for its norm.
    An update is applied before its own norm is known: if that norm is not finite, the next step
    stops with an error (the weights are no longer finite) instead of training on.
  - "off": no clipping; bind refuses `max_grad_norm`.
`last_grad_norm` is the norm of the last step's gradients; with "previous-norm", of the one before.

NOTE: [Host step deadlines]
The plan gives every host optimizer step a window to start in and one to end by (solver/step_model.py):
unclipped (or clipped by the previous norm), a host step starts when its gradient has landed and
ends inside its own step, so `step()` waits for the host steps still running before it returns.
Letting them run on into the next forward measured slower than the plan on the H200 (a 1.5B plan at
40 GiB, bf16 masters: the forward beside a host step took 7.5-9 ms a layer against 4.2 ms, its
launching thread sharing the CPU). With exact clipping they start after backward and run beside the
next step's forward, each done before its stage's prefetch, which waits for it. A disk-stepped
stage's job, which waits on its disk and holds little CPU, always may (NOTE: [Disk-stepped stages] in
solver/disk_model.py).

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

NOTE: [Step allocations] The caching allocator reuses a freed block only for the stream it was
allocated on, and at its cap it frees every cached block (a device-wide sync) and maps pages again.
The plan counts one pool. So the large tensors a device step makes come from the compute stream's
pool, where backward has just freed as much: the fp32 gradients of fp32 masters are converted there
before the step is issued (the step's stream keeps them with `record_stream`), and bf16 masters'
twins are made in pieces (NOTE: [Twin chunks] in sizes.py). Made on the optimizer stream at a
tight budget, the 1.5B's 0.93 GB fp32 embedding gradient took 69 ms against the plan's 2 ms and the
forward after it paged memory in again (H200, 40 GiB, 9 cache flushes in 5 steps, 2026-12-01).
The plan counts what a step beside backward costs compute and how fast it advances there (NOTE:
[Device steps beside compute] in hardware/__init__.py).
"""

from __future__ import annotations

import contextlib
import math

import torch

from lazytrain.errors import TrainingError
from lazytrain.ir.events import Event


class Stepping:
    """The optimizer side of `Trainer` (a mixin)."""

    def _add_norm(self, grads):
        if grads:
            sq = torch.stack(torch._foreach_norm(grads)).float().pow(2).sum()
            self.norm_sq = sq if self.norm_sq is None else self.norm_sq + sq

    def _global_norm_sq(self) -> torch.Tensor:
        """This step's squared gradient norm; with sharded state, over every rank's shards (NOTE:
        [Sharded state] in sharding.py)."""
        norm_sq = self.norm_sq if self.norm_sq is not None else torch.zeros(())
        return self.dp.total(norm_sq) if self.sharding else norm_sq

    def _clip_coefficient(self) -> float | None:
        """torch.nn.utils.clip_grad_norm_'s coefficient, or None when the norm is not finite."""
        self.norm_sq = self._global_norm_sq()
        norm = math.sqrt(self.norm_sq.item())
        self.last_grad_norm = norm
        if not math.isfinite(norm):
            return None
        return min(1.0, self.max_grad_norm / (norm + 1e-6))

    def _early_coefficient(self) -> float | None:
        """The clipping coefficient optimizer steps may use as they come during backward, or None when
        they must wait for this step's global norm (NOTE: [Gradient clipping])."""
        if self.max_grad_norm is None:
            return 1.0
        if self.clipping != "previous-norm" or self.previous_norm_sq is None:
            return None
        with self.streams.compute_context():
            norm = math.sqrt(self.previous_norm_sq.item())
        self.last_grad_norm = norm
        if not math.isfinite(norm):
            raise TrainingError(
                f"the last step's gradient norm is {norm}: with --clipping previous-norm its update was applied "
                "before its norm was known, so the weights are no longer finite. Resume from the last checkpoint, "
                "with a lower learning rate or --clipping exact (which skips such a step)")
        return min(1.0, self.max_grad_norm / (norm + 1e-6))

    def _wait_host_steps(self, disk_jobs: bool = True) -> None:
        """The host optimizer steps still running: they end inside their step (NOTE: [Host step
        deadlines]); with `disk_jobs`, disk-stepped stages' jobs too, which may end later."""
        for s in [s for s in self.cpu_jobs if disk_jobs or s not in self.disk_stepper.params]:
            self.cpu_jobs.pop(s).result()

    def _record_backward_steps(self, coef: float) -> None:
        """Stages stepped in their backward (NOTE: [Backward steps] in solver/step_model.py): this
        step's updates, recorded before its backward prefetches fetch them."""
        for s in self.stepper.backward:
            self.stepper.record(s, self.optimizer.hyperparameters(s), coef)

    def _record_gpu_steps(self, coef: float) -> None:
        """GPU-stepped streamed stages: their gradients wait on the host for the next prefetch."""
        for s, names in self.stepper.params.items():
            if s in self.stepper.backward:
                continue
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
                streamed = s >= 0 and self.stages[s].placement.streamed
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

    def _disk_step(self, s: int, hyper: dict, coef: float) -> None:
        """A disk-stepped stage's job, on the host worker: its states from disk, the step on the GPU
        in the one slot such jobs share, the states back to disk. On a GPU the copies and the step
        run on this thread's current stream, the device's default: the optimizer stream."""
        with torch.cuda.device(self.device) if self.cuda else contextlib.nullcontext():
            self._load_states(s)
            self.disk_stepper.step_from_disk(s, self._group(s), hyper, coef, self.disk_step_slot)
            if self.cuda:  # the states must be back in host memory before they are written: the
                # job's own work, not the stream's, where the main thread queues more steps meanwhile
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(self.device))
                self._read_ahead()  # a job submitted meanwhile: its read beside the wait
                done.synchronize()
            self.disk_states.store(s)

    def _load_states(self, s: int) -> None:
        """On the host worker, as stage `s`'s job starts: its states from disk, and those of the
        disk-stepped job most likely next read ahead (NOTE: [Disk reads ahead] in disk_states.py)."""
        self.disk_states.load(s)
        self._read_ahead()

    def _read_ahead(self) -> None:
        after = self.streams.next_due()
        if after is not None:
            self.disk_states.read_ahead(after)

    def _opt_step(self, e: Event, coef: float):
        s = e.stage
        names = self._names(s)
        hyper = self.optimizer.hyperparameters(self._group(s))  # a later LR scheduler step must not reach it

        def step(absorb: bool = True):
            if absorb:
                self._absorb_grads(stage=s)
            if coef != 1.0:
                for p in names:
                    if self.store.home[p].grad is not None:
                        self.store.home[p].grad.mul_(coef)
            self.optimizer.step_group(self._group(s), hyper)

        if e.device == "disk":  # NOTE: [Disk-stepped stages] in solver/disk_model.py
            self.fresh.difference_update(names)  # its job consumes the gradients in the host buffers
            # the next forward reads stage s at its prefetch: the lower, the sooner (NOTE: [Host jobs by deadline])
            self.cpu_jobs[s] = self.streams.host(e, lambda: self._disk_step(s, hyper, coef), due=s)
        elif e.device == "cpu":
            def host_step():
                if self.disk_states is not None and s in self.disk_states.homes:  # NOTE: [Disk-resident states]
                    self._load_states(s)
                    step()
                    self.disk_states.store(s)
                else:
                    step()
                self.store.refresh_source(names)
                for p in names:  # consumed: the next step starts from fresh gradients
                    self.store.home[p].grad = None
            self.cpu_jobs[s] = self.streams.host(e, host_step)
            if self.sharded:  # gathered at its next prefetch, or by synchronize()
                self.pending_gather.add(s)
        else:
            with self.streams.compute_context():  # NOTE: [Step allocations]
                self._absorb_grads(stage=s)

            def device_step():
                grads = [t.grad for p in names for t in (self.store.work[p], self.store.home[p]) if t.grad is not None]
                step(absorb=False)
                self.store.refresh_work(names)
                if self.cuda:  # the next step drops these gradients while this stream may still read them
                    for g in grads:
                        g.record_stream(torch.cuda.current_stream())
            self.streams.run_aside(e, device_step, after_compute=True)
            self.issued.add(s)
            if self.sharded:  # its GATHER event follows
                self.pending_gather.add(s)
