"""The plan: what the solver decided for each stage, and what it predicts."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class OutMode(enum.Enum):
    # What happens to a stage's output activations between its forward and its consumers' backward.
    KEEP = "keep"  # stay in GPU memory
    OFFLOAD = "offload"  # copied to host after the forward consumers, reloaded before backward
    DROP = "drop"  # freed after the next stage's forward, recomputed in backward


@dataclass(frozen=True, slots=True)
class StageDecision:
    stream: bool  # weights live on the host and are prefetched for forward and backward
    recompute: bool  # internals recomputed in backward (True) or saved by autograd (False)
    outputs: OutMode

    @property
    def optimizer(self) -> str:
        """Where the stage's optimizer step runs: beside its master weights."""
        return "cpu" if self.stream else "gpu"


@dataclass(frozen=True, slots=True)
class SolverInfo:
    status: str  # "optimal", "feasible", "fallback"
    gap: float
    objective_s: float
    bound_s: float
    seconds: float
    message: str = ""


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
