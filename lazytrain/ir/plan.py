"""The plan: what the solver decided for each stage, and what it predicts."""

from __future__ import annotations

from dataclasses import dataclass

from lazytrain.ir.placement import Placement


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
    decisions: tuple[Placement, ...]  # one per stage (ir/placement.py)
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
