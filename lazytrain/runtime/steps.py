"""The optimizer step's runtime handlers, one per kind (`Placement.kind`, ir/placement.py). Each
stage's OPT_STEP event goes to the handler of its kind (the shared weights' to "resident"):

    resident  on the optimizer stream as its backward ends (NOTE: [Optimizer stream] in stepping.py)
    host      AdamW on the host worker, its states in host memory or on disk
    job       on the device by a host worker's job that reads its states from disk
    prefetch  last step's update, on the device at this step's forward prefetch
    backward  on the device right after its backward, on the gradients there

The first three (`WaitsForNorm`) need the step's clipping coefficient: where it is not known yet (exact clipping,
NOTE: [Gradient clipping] in stepping.py) they wait until backward has ended (`Turn.deferred`).
A new kind is a class here and its line in `handlers`.
"""

from __future__ import annotations

import abc
import contextlib
from concurrent.futures import Future
from dataclasses import dataclass, field

import torch

from lazytrain.ir.events import Event


@dataclass
class Turn:
    """One training step's optimizer side, as its events meet it."""
    optimize: bool  # a step (`step`), not `forward_backward`
    coef: float | None  # the clipping coefficient steps may use as they come; None: they wait for this step's norm
    deferred: list[Event] = field(default_factory=list)  # OPT_STEPs waiting for it, as met
    gathers: dict[int, Event] = field(default_factory=dict)  # their GATHERs (NOTE: [Sharded state]), run after them

    def defers(self, stage: int) -> bool:
        return any(d.stage == stage for d in self.deferred)

    def in_order(self) -> list[Event]:
        """The deferred steps in forward order, the shared weights' last: the next forward can start
        on the first stages updated."""
        return sorted(self.deferred, key=lambda e: (e.stage < 0, e.stage))


class StepKind(abc.ABC):
    """A kind's handler. `issue` meets the kind's OPT_STEP event in the event loop."""

    @abc.abstractmethod
    def issue(self, e: Event, turn: Turn) -> None: ...


class WaitsForNorm(StepKind):
    """A kind whose step needs this step's clipping coefficient: it runs where its event is met
    (`run`) if the coefficient is known, else it waits for it (`Turn.deferred`)."""

    def issue(self, e: Event, turn: Turn) -> None:
        if turn.coef is not None:
            self.run(e, turn.coef)
        elif turn.optimize:
            turn.deferred.append(e)

    @abc.abstractmethod
    def run(self, e: Event, coef: float) -> None: ...


class _OnHomes(WaitsForNorm):
    """A step of the homes themselves: torch's optimizer on the gradients absorbed into their `.grad`."""

    def __init__(self, groups, store, optimizer, streams, gradients, sharding):
        self.groups, self.store, self.optimizer, self.streams = groups, store, optimizer, streams
        self.gradients, self.sharding = gradients, sharding

    def _adamw(self, s: int, hyper: dict, coef: float, absorb: bool = True) -> None:
        if absorb:
            self.gradients.absorb(s)
        if coef != 1.0:
            for p in self.groups.names(s):
                if self.store.home[p].grad is not None:
                    self.store.home[p].grad.mul_(coef)
        self.optimizer.step_group(self.groups.index(s), hyper)


class ResidentStep(_OnHomes):
    """On the optimizer stream, after the compute issued so far (NOTE: [Optimizer stream] in stepping.py)."""

    def run(self, e: Event, coef: float) -> None:
        s = e.stage
        names = self.groups.names(s)
        hyper = self.optimizer.hyperparameters(self.groups.index(s))  # a later LR scheduler step must not reach it
        with self.streams.compute_context():  # NOTE: [Step allocations] in stepping.py
            self.gradients.absorb(s)

        def device_step():
            grads = [t.grad for p in names for t in (self.store.work[p], self.store.home[p]) if t.grad is not None]
            self._adamw(s, hyper, coef, absorb=False)
            self.store.refresh_work(names)
            if self.store.cuda:  # the next step drops these gradients while this stream may still read them
                for g in grads:
                    g.record_stream(torch.cuda.current_stream())
        self.streams.run_aside(e, device_step, after_compute=True)
        self.gradients.issued.add(s)
        if self.sharding is not None:  # its GATHER event follows
            self.sharding.updated(s)


class HostStep(_OnHomes):
    """On the host worker once its gradient has landed (NOTE: [Host step deadlines] in stepping.py)."""

    def __init__(self, groups, store, optimizer, streams, gradients, sharding, jobs: dict[int, Future], disk_states):
        super().__init__(groups, store, optimizer, streams, gradients, sharding)
        self.jobs, self.disk_states = jobs, disk_states

    def run(self, e: Event, coef: float) -> None:
        s = e.stage
        names = self.groups.names(s)
        hyper = self.optimizer.hyperparameters(self.groups.index(s))  # a later LR scheduler step must not reach it

        def host_step():
            if self.disk_states is not None and s in self.disk_states.homes:  # NOTE: [Disk-resident states]
                _load_states(self.disk_states, self.streams, s)
                self._adamw(s, hyper, coef)
                self.disk_states.store(s)
            else:
                self._adamw(s, hyper, coef)
            self.store.refresh_source(names)
            for p in names:  # consumed: the next step starts from fresh gradients
                self.store.home[p].grad = None
        self.jobs[s] = self.streams.host(e, host_step)
        if self.sharding is not None:  # gathered at its next prefetch, or by synchronize()
            self.sharding.updated(s)


class DiskJob(WaitsForNorm):
    """NOTE: [Disk-stepped stages] in solver/disk_model.py: a host worker's job reads the stage's
    states from disk, steps it on the GPU in the one slot such jobs share (the schedule's `dstep`
    buffer), and writes the states back."""

    def __init__(self, groups, optimizer, streams, gradients, jobs: dict[int, Future], disk_states, stepper,
                 slot: torch.Tensor | None, device: torch.device):
        self.groups, self.optimizer, self.streams, self.gradients = groups, optimizer, streams, gradients
        self.jobs, self.disk_states, self.stepper, self.slot, self.device = jobs, disk_states, stepper, slot, device

    def run(self, e: Event, coef: float) -> None:
        s = e.stage
        hyper = self.optimizer.hyperparameters(self.groups.index(s))  # a later LR scheduler step must not reach it
        self.gradients.fresh.difference_update(self.groups.names(s))  # its job consumes the gradients in the host buffers
        # the next forward reads stage s at its prefetch: the lower, the sooner (NOTE: [Host jobs by deadline])
        self.jobs[s] = self.streams.host(e, lambda: self._job(s, hyper, coef), due=s)

    def _job(self, s: int, hyper: dict, coef: float) -> None:
        """On the host worker. On a GPU the copies and the step run on this thread's current stream,
        the device's default: the optimizer stream."""
        cuda = self.device.type == "cuda"
        with torch.cuda.device(self.device) if cuda else contextlib.nullcontext():
            _load_states(self.disk_states, self.streams, s)
            self.stepper.step_from_disk(s, self.groups.index(s), hyper, coef, self.slot)
            if cuda:  # the states must be back in host memory before they are written: the
                # job's own work, not the stream's, where the main thread queues more steps meanwhile
                done = torch.cuda.Event()
                done.record(torch.cuda.current_stream(self.device))
                _read_ahead(self.disk_states, self.streams)  # a job submitted meanwhile: its read beside the wait
                done.synchronize()
            self.disk_states.store(s)


class PrefetchStep(StepKind):
    """Last step's update of a GPU-stepped streamed stage, at its prefetch (gpu_step.py), beside the
    compute before it: it waits only for its prefetch (the schedule's waits)."""

    def __init__(self, groups, streams, stepper, sharding):
        self.groups, self.streams, self.stepper, self.sharding = groups, streams, stepper, sharding

    def issue(self, e: Event, turn: Turn) -> None:
        self.streams.run_aside(e, lambda s=e.stage: self._step(s), after_compute=False)

    def _step(self, s: int) -> None:
        if self.stepper.step(s, self.groups.index(s)) and self.sharding is not None:
            self.sharding.updated(s)


class BackwardStep(StepKind):
    """A stage stepped right after its backward, on the gradients there; without a step
    (`forward_backward`) they go to the host for `.grad` instead (NOTE: [Backward steps] in
    solver/step_model.py)."""

    def __init__(self, groups, streams, stepper, gradients):
        self.groups, self.streams, self.stepper, self.gradients = groups, streams, stepper, gradients

    def issue(self, e: Event, turn: Turn) -> None:
        self.streams.run_aside(e, lambda s=e.stage: self._step(s, turn.optimize), after_compute=True)

    def _step(self, s: int, optimize: bool) -> None:
        grads = self.gradients.parked.get(s, {})
        if optimize:
            self.stepper.step(s, self.groups.index(s), grads=grads)
            return
        for name, g in grads.items():
            if g is not None:
                self.gradients.host[name] = g.to("cpu", copy=True)
                self.gradients.fresh.add(name)


def handlers(groups, store, optimizer, streams, gradients, sharding, jobs: dict[int, Future], stepper, disk_states,
             disk_stepper, disk_slot, device) -> dict[str, StepKind]:
    """The table: kind -> its handler. `stepper` steps the stages at their prefetch and in their
    backward, `disk_stepper` the disk jobs' in `disk_slot`; `jobs` collects the host worker's."""
    return {
        "resident": ResidentStep(groups, store, optimizer, streams, gradients, sharding),
        "host": HostStep(groups, store, optimizer, streams, gradients, sharding, jobs, disk_states),
        "job": DiskJob(groups, optimizer, streams, gradients, jobs, disk_states, disk_stepper, disk_slot, device),
        "prefetch": PrefetchStep(groups, streams, stepper, sharding),
        "backward": BackwardStep(groups, streams, stepper, gradients),
    }


def _load_states(disk_states, streams, s: int) -> None:
    """On the host worker, as stage `s`'s step starts: its states from disk, and those of the
    disk-stepped job most likely next read ahead (NOTE: [Disk reads ahead] in disk_states.py)."""
    disk_states.load(s)
    _read_ahead(disk_states, streams)


def _read_ahead(disk_states, streams) -> None:
    after = streams.next_due()
    if after is not None:
        disk_states.read_ahead(after)
