"""The plan: what the solver decided for each stage, and what it predicts."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class OutMode(enum.Enum):
    # What happens to a stage's output activations between its forward and its consumers' backward.
    KEEP = "keep"  # stay in GPU memory
    OFFLOAD = "offload"  # copied to host after the forward consumers, reloaded before backward
    DROP = "drop"  # freed after the next stage's forward, recomputed in backward
    # offloaded as OFFLOAD is, then written from host memory to the offload file, and read back into
    # host memory before the reload (NOTE: [Activations on disk] in passes/disk_model.py)
    DISK = "disk"

    @property
    def offloaded(self) -> bool:
        """Leaves the GPU between its forward consumers and its reload: to host memory or to disk."""
        return self in (OutMode.OFFLOAD, OutMode.DISK)


@dataclass(frozen=True, slots=True)
class StageDecision:
    stream: bool  # weights live on the host and are prefetched for forward and backward
    recompute: bool  # internals recomputed in backward (True) or saved by autograd (False)
    outputs: OutMode
    # Streamed stages only: the optimizer step runs on the GPU, with the fp32 master weights,
    # optimizer states and gradients streamed in at the next step's prefetch and back out after
    # (NOTE: [GPU-stepped streamed stages] in solve.py); else on the CPU beside the masters.
    gpu_step: bool = False
    # GPU-stepped only: the prefetch that brings master, states and gradient in starts this many
    # forward windows ahead (1, or 2 to give the transfer two windows)
    lookahead: int = 1
    # Streamed only: its optimizer states live on disk between steps. Host-stepped: its AdamW moments,
    # read in before its host step and written back after it (NOTE: [Disk-resident states] in
    # passes/disk_model.py); with `gpu_step`, its states, and its step is a job of its own that reads
    # them, steps on the GPU and writes them back (NOTE: [Disk-stepped stages] there)
    disk: bool = False
    # GPU-stepped only: the step runs right after the stage's backward, on the gradient there (no host
    # copy of it), with master and states fetched beside the backward prefetch and written back
    # after (NOTE: [Backward steps] in passes/step_model.py); needs clipping off or previous-norm. With
    # `disk`, its states pass through host memory only around that step (NOTE: [Backward steps from
    # disk] there)
    backward_step: bool = False
    # Resident only: its gradients go after B(s-2), its step beside backward done by then (NOTE:
    # [Resident gradients freed at their step] in passes/footprint.py); else they stay to the next step
    free_grads: bool = False
    # Resident only, fp32 masters of 16-bit weights: no compute copy between uses; the weights are cast
    # from the master before its forward and its backward (NOTE: [Resident weights cast on use] in
    # passes/footprint.py)
    cast_weights: bool = False
    # Stepped in backward from disk, fp32 masters of 16-bit weights: the master lives in the offload
    # file too, passing through the ring with the states, and the host keeps the compute-dtype copy
    # the prefetches read (NOTE: [Masters on disk] in passes/disk_model.py)
    master_disk: bool = False

    @property
    def at_prefetch(self) -> bool:
        """GPU-stepped at its next forward prefetch (NOTE: [GPU-stepped streamed stages] in solve.py)."""
        return self.gpu_step and not self.disk and not self.backward_step

    @property
    def disk_step(self) -> bool:
        """Stepped on the GPU by a job that reads its states from disk and writes them back."""
        return self.gpu_step and self.disk and not self.backward_step

    @property
    def disk_backward(self) -> bool:
        """Stepped in backward, its states read from disk before and written back after (NOTE:
        [Backward steps from disk] in passes/disk_model.py)."""
        return self.backward_step and self.disk

    @property
    def optimizer(self) -> str:
        """Where the stage's optimizer step runs."""
        return "cpu" if self.stream and not self.gpu_step else "gpu"

    def states(self, chosen: str) -> str:
        """The precision of the stage's optimizer states when `chosen` ("32bit" or "8bit") was
        asked for (NOTE: [State precision per stage] in solve.py)."""
        return "32bit" if self.optimizer == "cpu" else chosen


@dataclass(frozen=True, slots=True)
class SolverInfo:
    status: str  # "optimal", "feasible", "fallback"
    gap: float
    objective_s: float
    bound_s: float
    seconds: float
    message: str = ""
    solver: str = ""  # the MIP solver that ran: "highs" or "cbc"
    times: tuple[tuple[str, float], ...] = ()  # seconds per part of the solve, in order (`--time-passes`)


@dataclass(frozen=True, slots=True)
class Plan:
    decisions: tuple[StageDecision, ...]
    budget: int
    peak_bytes: int
    host_bytes: int
    step_s: float
    compute_s: float
    recompute_s: float
    exposed_s: float
    optimizer_s: float
    windows: tuple[tuple[str, int, float], ...]  # (label, predicted GPU bytes, seconds) in time order
    solver: SolverInfo
    disk_bytes: int = 0  # optimizer states on disk, each read and written once a step
    disk_s: float = 0.0  # seconds of the disk's time reading and writing them each step (NOTE: [Disk-resident states])
