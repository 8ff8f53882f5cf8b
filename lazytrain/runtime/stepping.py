"""Gradients into the optimizer: the global norm, clipping, and each stage's AdamW step where
the schedule places it (the host CPU, the optimizer stream, or a GPU-stepped streamed stage's next
prefetch). `Stepping` is the `Trainer`'s optimizer side; each kind of step runs in its handler in
steps.py.

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

import math
from concurrent.futures import Future

import torch

from lazytrain.errors import TrainingError
from lazytrain.ir.events import Event
from lazytrain.runtime.gpu_step import GpuStepper
from lazytrain.runtime.gradients import Gradients
from lazytrain.runtime.groups import Groups
from lazytrain.runtime.steps import Turn, handlers


class Stepping:
    """The optimizer side of a `Trainer`: this step's clipping coefficient, each OPT_STEP event run by
    its stage's kind (steps.py), and the host worker's steps still running. `begin` opens a step's
    `Turn`, which the event loop hands each OPT_STEP (`issue`); `after_backward` gives the step's
    coefficient, with which the steps that waited for it then `run`."""

    def __init__(self, stages, groups: Groups, store, optimizer, streams, gradients: Gradients, sharding, dp,
                 stepper: GpuStepper, disk_stepper: GpuStepper, disk_states, disk_slot, device: torch.device, *,
                 max_grad_norm: float | None, clipping: str, serial: bool):
        self.optimizer, self.streams, self.gradients, self.sharding, self.dp = optimizer, streams, gradients, sharding, dp
        self.stepper, self.disk_stepper = stepper, disk_stepper
        self.ring = disk_states.ring if disk_states is not None else None  # NOTE: [Backward steps from disk]
        self.max_grad_norm = max_grad_norm
        self.clipping = clipping  # NOTE: [Gradient clipping]
        self.serial = serial  # the baseline: every optimizer step after backward, waited for
        self.previous_norm_sq: torch.Tensor | None = None  # "previous-norm": the last step's squared global norm
        self.last_grad_norm: float | None = None
        self.skipped_steps = 0
        self.jobs: dict[int, Future] = {}  # stage -> its step on the host worker, still running
        self.kind = {i: s.placement.kind for i, s in enumerate(stages)}
        self.kind[-1] = "resident"  # the shared weights: on the device, beside their homes
        self.handlers = handlers(groups, store, optimizer, streams, gradients, sharding, self.jobs, stepper,
                                 disk_states, disk_stepper, disk_slot, device)

    # ---- a step -------------------------------------------------------------------------------
    def begin(self, optimize: bool) -> Turn:
        """A step's turn, with the coefficient its steps may use as they come (None: they wait)."""
        coef = self._early_coefficient() if optimize and not self.serial else None
        # NOTE: [Backward steps], [Resident gradients freed at their step]: they cannot wait for this step's norm
        if optimize and (self.stepper.backward or self.gradients.freed):
            coef = 1.0 if coef is None else coef  # previous-norm's first step: none to clip by yet
            self._record_backward_steps(coef)
            if self.ring is not None:  # NOTE: [Backward steps from disk]: their states read in backward's order
                self.ring.read(sorted(self.ring.stages, reverse=True))
        return Turn(optimize, coef)

    def issue(self, e: Event, turn: Turn) -> None:
        """An OPT_STEP event met in the loop, to its stage's kind."""
        self.handlers[self.kind[e.stage]].issue(e, turn)

    def run(self, e: Event, coef: float) -> None:
        """A step that waited for this step's coefficient (`Turn.deferred`)."""
        self.handlers[self.kind[e.stage]].run(e, coef)

    def after_backward(self, turn: Turn) -> float | None:
        """This step's clipping coefficient once backward has ended (None: the norm is not finite, skip
        the update); with "previous-norm", the next step's norm kept."""
        coef = turn.coef
        if turn.optimize and self.max_grad_norm is not None:  # this step's global norm: its clipping, or the next's
            with self.streams.compute_context():
                waited = coef is None
                if waited:
                    coef = self._clip_coefficient()  # leaves the global norm in norm_sq
                if self.clipping == "previous-norm" and coef is not None:  # the next step clips by it
                    self.previous_norm_sq = self.gradients.norm_sq if waited else self._global_norm_sq()
        elif turn.optimize:
            coef = 1.0
        return coef

    def skip(self) -> None:
        """A step whose norm is not finite: no update; its gradients in the host buffers are dropped."""
        self.skipped_steps += 1
        self.gradients.fresh.clear()

    # ---- the norm -----------------------------------------------------------------------------
    def _global_norm_sq(self) -> torch.Tensor:
        """This step's squared gradient norm; with sharded state, over every rank's shards (NOTE:
        [Sharded state] in sharding.py)."""
        norm_sq = self.gradients.norm_sq if self.gradients.norm_sq is not None else torch.zeros(())
        return self.dp.total(norm_sq) if self.sharding is not None and self.sharding.scattering else norm_sq

    def _clip_coefficient(self) -> float | None:
        """torch.nn.utils.clip_grad_norm_'s coefficient, or None when the norm is not finite."""
        self.gradients.norm_sq = self._global_norm_sq()
        norm = math.sqrt(self.gradients.norm_sq.item())
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

    # ---- steps of streamed stages on the device -------------------------------------------------
    def _record_backward_steps(self, coef: float) -> None:
        """Stages stepped in their backward (NOTE: [Backward steps] in solver/step_model.py): this
        step's updates, recorded before its backward prefetches fetch them."""
        for s in self.stepper.backward:
            self.stepper.record(s, self.optimizer.hyperparameters(s), coef)

    def record_gpu_steps(self, coef: float) -> None:
        """GPU-stepped streamed stages: their gradients wait on the host for the next prefetch."""
        for s, names in self.stepper.params.items():
            if s in self.stepper.backward:
                continue
            if any(p in self.gradients.fresh for p in names):
                self.stepper.record(s, self.optimizer.hyperparameters(s), coef)
                self.gradients.fresh.difference_update(names)

    # ---- the host worker's steps ----------------------------------------------------------------
    def running(self, s: int) -> bool:
        """Stage `s`'s step still runs on the host worker."""
        return s in self.jobs

    def wait_host_step(self, s: int) -> None:
        """Stage `s`'s step on the host worker, if one runs, finishes (its prefetch reads what it updates)."""
        job = self.jobs.pop(s, None)
        if job is not None:
            job.result()

    def wait_host_steps(self, disk_jobs: bool = True) -> None:
        """The host optimizer steps still running: they end inside their step (NOTE: [Host step
        deadlines]); with `disk_jobs`, disk-stepped stages' jobs too, which may end later."""
        for s in [s for s in self.jobs if disk_jobs or s not in self.disk_stepper.params]:
            self.jobs.pop(s).result()
