"""A stage's placement: what the plan decides for it, as four orthogonal axes.

    weights    resident on the device, or streamed from the host with a forward lookahead
    internals  saved by autograd from forward to backward, or recomputed in backward
    outputs    kept on the device, offloaded to the host, offloaded on to disk (whole, or split by
               the tile between device, host and disk: `Split`), or dropped and recomputed
    step       where its optimizer step runs (device or host), when (beside its backward, at the next
               step's forward prefetch, or as a job of its own), and where its master and optimizer
               states live between steps (device, host or disk)

Each axis admits only its valid values, and `Placement` refuses combinations across axes that no
runtime path implements (`PlacementError`), so a plan, a cache entry or a schedule line that names
one cannot be built. The optimizer step's valid shapes are its kinds (`Step.kind`): each is one
registered rule in the planner (solver/steps/) and one handler in the runtime.

The solver, `lower`, codegen, `inspect` and the runtime all read this one value: the runtime
imports it (pure Python, no torch: NOTE: [Runtime imports] in runtime/schedule.py), and a schedule
writes each stage's placement as a constructor call (`repr`) it evaluates back.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

from lazytrain.errors import PlanError


class PlacementError(PlanError):
    """A combination of placement axes that no runtime path implements."""


class Internals(enum.Enum):
    SAVED = "saved"  # autograd keeps them from the stage's forward to its backward
    RECOMPUTED = "recomputed"  # its forward runs again at the top of its backward

    def __repr__(self) -> str:
        return f"Internals.{self.name}"


class Outputs(enum.Enum):
    # What happens to a stage's output activations between its forward and its consumers' backward.
    KEEP = "keep"  # stay in GPU memory
    OFFLOAD = "offload"  # copied to host after the forward consumers, reloaded before backward
    DROP = "drop"  # freed after the next stage's forward, recomputed in backward
    # offloaded as OFFLOAD is, then written from host memory to the offload file, and read back into
    # host memory before the reload (NOTE: [Activations on disk] in solver/disk_model.py)
    DISK = "disk"

    @property
    def offloaded(self) -> bool:
        """Leaves the GPU between its forward consumers and its reload: to host memory or to disk."""
        return self in (Outputs.OFFLOAD, Outputs.DISK)

    def __repr__(self) -> str:
        return f"Outputs.{self.name}"


class On(enum.Enum):
    """Where an optimizer step runs. The values are the plan's words ("gpu": the compute device)."""
    DEVICE = "gpu"
    HOST = "cpu"

    def __repr__(self) -> str:
        return f"On.{self.name}"


class When(enum.Enum):
    """When an optimizer step runs within the training loop."""
    BACKWARD = "backward"  # as its backward ends (a resident stage: beside backward, or after it with exact clipping)
    PREFETCH = "prefetch"  # at the next step's forward prefetch of its weights (NOTE: [GPU-stepped streamed stages])
    JOB = "job"  # a job of the host worker once its gradient has landed, done before its next prefetch

    def __repr__(self) -> str:
        return f"When.{self.name}"


class Tier(enum.Enum):
    """Where a stage's master weights or optimizer states live between steps."""
    DEVICE = "device"
    HOST = "host"
    DISK = "disk"  # the offload file (NOTE: [Disk-resident states] in solver/disk_model.py)

    def __repr__(self) -> str:
        return f"Tier.{self.name}"


@dataclass(frozen=True, slots=True)
class Weights:
    """Resident on the device between steps, or streamed: kept on the host and prefetched for the
    stage's forward and again for its backward."""
    streamed: bool = False
    # streamed only: the forward prefetch starts this many windows ahead; 2 only for a step at the
    # prefetch, which then has two windows to land (NOTE: [GPU-step lag] in solver/formulation.py)
    lookahead: int = 1
    # resident only, fp32 masters of 16-bit weights: no compute copy between uses; the weights are
    # cast from the master before its forward and its backward (NOTE: [Resident weights cast on use]
    # in solver/footprint.py)
    cast_on_use: bool = False

    def __post_init__(self):
        if self.lookahead not in (1, 2):
            raise PlacementError(f"weights lookahead {self.lookahead!r}: a forward prefetch is 1 or 2 windows ahead")
        if not self.streamed and self.lookahead != 1:
            raise PlacementError("resident weights are never prefetched: lookahead applies to streamed weights")
        if self.streamed and self.cast_on_use:
            raise PlacementError("streamed weights arrive in the compute dtype: cast on use applies to resident weights")

    def __repr__(self) -> str:
        if not self.streamed:
            return "Weights(cast_on_use=True)" if self.cast_on_use else "Weights()"
        return "Weights(streamed=True" + (f", lookahead={self.lookahead})" if self.lookahead != 1 else ")")


@dataclass(frozen=True, slots=True)
class Step:
    """Where and when a stage's optimizer step runs, and where its master and states live between
    steps. Only the shapes in `KINDS` exist; use the named constructors."""
    on: On
    when: When
    states: Tier
    master: Tier
    # resident only: its gradients go after B(s-2), its step issued beside backward by then (NOTE:
    # [Resident gradients freed at their step] in solver/footprint.py); else they stay to the next step
    frees_grads: bool = False

    def __post_init__(self):
        if (self.on, self.when, self.states, self.master) not in KINDS:
            raise PlacementError(
                f"no optimizer step runs on {self.on.value} at {self.when.value} with states on {self.states.value} and "
                f"master on {self.master.value}; the kinds are: {', '.join(sorted(set(KINDS.values())))}")
        if self.frees_grads and self.kind != "resident":
            raise PlacementError("only a resident stage's step frees its gradients early: the others' leave the device")

    @property
    def kind(self) -> str:
        """The step's rule: "resident", "host", "prefetch", "job" or "backward"."""
        return KINDS[(self.on, self.when, self.states, self.master)]

    # ---- the kinds --------------------------------------------------------------------------------
    @staticmethod
    def resident(frees_grads: bool = False) -> Step:
        """On the device as its backward ends, master and states there."""
        return Step(On.DEVICE, When.BACKWARD, Tier.DEVICE, Tier.DEVICE, frees_grads)

    @staticmethod
    def host(states: Tier = Tier.HOST) -> Step:
        """AdamW on the host beside the master once the gradient has landed; the fp32 moments in host
        memory, or on disk (NOTE: [Disk-resident states] in solver/disk_model.py)."""
        return Step(On.HOST, When.JOB, states, Tier.HOST)

    @staticmethod
    def at_prefetch() -> Step:
        """On the device at the next step's forward prefetch: the fp32 master, the optimizer states and
        the gradient streamed in with it and back out after (NOTE: [GPU-stepped streamed stages] in
        solver/formulation.py)."""
        return Step(On.DEVICE, When.PREFETCH, Tier.HOST, Tier.HOST)

    @staticmethod
    def job() -> Step:
        """On the device by a job of its own that reads the states from disk and writes them back
        (NOTE: [Disk-stepped stages] in solver/disk_model.py)."""
        return Step(On.DEVICE, When.JOB, Tier.DISK, Tier.HOST)

    @staticmethod
    def in_backward(states: Tier = Tier.HOST, master: Tier = Tier.HOST) -> Step:
        """On the device right after its backward, on the gradient there (no host copy of it), master
        and states fetched beside the backward prefetch and written back after (NOTE: [Backward
        steps] in solver/step_model.py); needs clipping off or by the previous norm. States on disk
        pass through host memory only around the step, in a ring of host buffers (NOTE: [Backward
        steps from disk] in solver/disk_model.py), and so may an fp32 master of 16-bit weights, the
        host then keeping the compute-dtype copy the prefetches read (NOTE: [Masters on disk] there)."""
        return Step(On.DEVICE, When.BACKWARD, states, master)

    def __repr__(self) -> str:
        kind = self.kind
        if kind == "resident":
            return "Step.resident(frees_grads=True)" if self.frees_grads else "Step.resident()"
        if kind == "host":
            return "Step.host(Tier.DISK)" if self.states is Tier.DISK else "Step.host()"
        if kind == "backward":
            args = ", ".join(repr(t) for t in (self.states, self.master)[:1 + (self.master is not Tier.HOST)]
                             ) if self.states is not Tier.HOST else ""
            return f"Step.in_backward({args})"
        return {"prefetch": "Step.at_prefetch()", "job": "Step.job()"}[kind]


# (on, when, states, master) -> kind: the optimizer steps the runtime implements
KINDS = {
    (On.DEVICE, When.BACKWARD, Tier.DEVICE, Tier.DEVICE): "resident",
    (On.HOST, When.JOB, Tier.HOST, Tier.HOST): "host",
    (On.HOST, When.JOB, Tier.DISK, Tier.HOST): "host",
    (On.DEVICE, When.PREFETCH, Tier.HOST, Tier.HOST): "prefetch",
    (On.DEVICE, When.JOB, Tier.DISK, Tier.HOST): "job",
    (On.DEVICE, When.BACKWARD, Tier.HOST, Tier.HOST): "backward",
    (On.DEVICE, When.BACKWARD, Tier.DISK, Tier.HOST): "backward",
    (On.DEVICE, When.BACKWARD, Tier.DISK, Tier.DISK): "backward",
}


@dataclass(frozen=True, slots=True)
class Split:
    """Offloaded outputs cut in `of` tiles (NOTE: [Boundary tiles] in solver/boundary.py): `device`
    of them stay on the device, `disk` go on to the offload file, and the rest to host memory. Each
    output tensor is cut in its memory order: the device's elements first, then the host's, then the
    disk's (`numels`)."""
    device: int
    disk: int
    of: int

    def __post_init__(self):
        if not (0 <= self.device and 0 <= self.disk and self.device + self.disk <= self.of) \
                or self.device == self.of or (self.device == 0 and self.disk in (0, self.of)):
            raise PlacementError(f"outputs split {self.device} on the device and {self.disk} on disk of {self.of} tiles: "
                                 "a split keeps part of them apart from the rest (all or none on the device, or all on "
                                 "disk, is no split)")

    @property
    def host(self) -> int:
        return self.of - self.device - self.disk

    def numels(self, n: int) -> tuple[int, int, int]:
        """Of a tensor of n elements: how many stay on the device (the first ceil(n * device / of)),
        go to the host, and go to disk (the last floor(n * disk / of))."""
        device, disk = -(-n * self.device // self.of), n * self.disk // self.of
        return device, n - device - disk, disk

    def __repr__(self) -> str:
        return f"Split({self.device}, {self.disk}, {self.of})"


@dataclass(frozen=True, slots=True)
class Placement:
    """One stage's decisions. Rules that depend on the stage's neighbours (a streamed stage before
    the last must recompute; dropped outputs need a recomputing consumer) are the planner's: pass
    `solve` states them, `verify` checks their consequences."""
    weights: Weights = Weights()
    internals: Internals = Internals.SAVED
    outputs: Outputs = Outputs.KEEP
    step: Step = Step.resident()
    # offloaded outputs only: where their tiles go; None: all of them to the host (OFFLOAD) or to disk
    # (DISK) (NOTE: [Boundary tiles] in solver/boundary.py)
    split: Split | None = None

    def __post_init__(self):
        streamed, kind = self.weights.streamed, self.step.kind
        if self.split is not None and (not self.outputs.offloaded or (self.split.disk > 0) != (self.outputs is Outputs.DISK)):
            raise PlacementError(f"outputs {self.outputs.value} cannot be split {self.split!r}: a split is of offloaded "
                                 "outputs, with tiles on disk where they are Outputs.DISK and only there")
        if streamed == (kind == "resident"):
            raise PlacementError(f"{'streamed' if streamed else 'resident'} weights cannot take a {kind} optimizer step: "
                                 "a resident stage steps on the device beside its master, a streamed one elsewhere")
        if self.weights.lookahead == 2 and kind != "prefetch":
            raise PlacementError("a 2-window lookahead serves a step at the prefetch only")
        if streamed and self.outputs is Outputs.DROP:
            raise PlacementError("a streamed stage's outputs are not dropped: recomputing them would fetch its weights again")
        if self.weights.cast_on_use and (self.internals is not Internals.RECOMPUTED or self.outputs is Outputs.DROP):
            raise PlacementError("weights cast on use need recomputed internals and outputs that are not dropped: "
                                 "saved internals and recomputed outputs would hold the cast copy")

    # ---- what the other parts ask -------------------------------------------------------------------
    @property
    def streamed(self) -> bool:
        return self.weights.streamed

    @property
    def recomputed(self) -> bool:
        return self.internals is Internals.RECOMPUTED

    @property
    def device_stepped(self) -> bool:
        """A streamed stage stepped on the device: at its prefetch, by a job, or in its backward."""
        return self.weights.streamed and self.step.on is On.DEVICE

    @property
    def kind(self) -> str:
        """The optimizer step's kind (`Step.kind`): the rule that plans it and the handler that runs it."""
        return self.step.kind

    @property
    def optimizer(self) -> str:
        """Where the stage's optimizer step runs: "gpu" or "cpu"."""
        return self.step.on.value

    def states(self, chosen: str) -> str:
        """The precision of the stage's optimizer states when `chosen` ("32bit" or "8bit") was
        asked for (NOTE: [State precision per stage] in solver/formulation.py)."""
        return "32bit" if self.step.on is On.HOST else chosen

    def __repr__(self) -> str:
        split = f", split={self.split!r}" if self.split is not None else ""
        return f"Placement({self.weights!r}, {self.internals!r}, {self.outputs!r}, {self.step!r}{split})"


NAMESPACE = {c.__name__: c for c in (Placement, Weights, Internals, Outputs, Split, Step, Tier, On, When)}


def describe(p: Placement, device: str = "cuda", states: str = "32bit", from_master: bool = False,
             chunks: int = 1) -> str:
    """The placement in words, the one line the schedule's header and `lazytrain inspect` both print.
    `device`: the schedule's device type (on the CPU the "GPU" is the device and the host is the
    host); `states`: the optimizer states' precision asked for (said where not 32-bit); `from_master`:
    its prefetches read the fp32 master (NOTE: [Weights from the master] in solver/footprint.py);
    `chunks`: a chunked loss stage's, whose internals are neither saved nor recomputed."""
    internals = f"{chunks} chunks" if chunks > 1 else p.internals.value
    where = p.optimizer if device == "cuda" else {"gpu": "device", "cpu": "host"}[p.optimizer]
    text = (f"{'streamed' if p.streamed else 'resident':<8}  internals {internals:<10}  outputs {p.outputs.value:<7}  "
            f"optimizer on {where}")
    step = p.step
    extra = [f"{p.states(states)} states"] if states != "32bit" else []
    if p.split is not None:
        split = p.split
        extra.append(f"outputs' {split.of} tiles: {split.device} kept, {split.host} to host, {split.disk} to disk")
    extra += {"prefetch": ["at its prefetch"], "backward": ["in its backward"], "job": ["in a job of its own"]}.get(step.kind, [])
    if p.weights.lookahead == 2:
        extra.append("fetched 2 windows ahead")
    if step.states is Tier.DISK:
        extra.append("states on disk")
    if step.master is Tier.DISK:
        extra.append("master on disk")
    if from_master:
        extra.append("weights fetched from its fp32 master")
    if p.weights.cast_on_use:
        extra.append("weights cast from its master on use")
    if step.frees_grads:
        extra.append("gradients freed at its step")
    return text + (f" ({', '.join(extra)})" if extra else "")


def old_flags(p: Placement) -> list:
    """The placement as the flags plans were written in before placements had a type: (stream,
    recompute, outputs, gpu_step, lookahead, disk, backward_step, free_grads, cast_weights,
    master_disk). For comparing plans across that change (bench/plans.py)."""
    kind = p.kind
    return [p.streamed, p.recomputed, p.outputs.value, p.streamed and p.step.on is On.DEVICE, p.weights.lookahead,
            p.step.states is Tier.DISK, kind == "backward", p.step.frees_grads, p.weights.cast_on_use,
            p.step.master is Tier.DISK]
