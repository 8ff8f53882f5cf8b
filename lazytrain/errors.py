"""The error hierarchy. Every message names the cause and says how to fix it."""

from __future__ import annotations


def one_line(exc: BaseException) -> str:
    """A foreign exception in one line, to quote inside a lazytrain message: its type and its
    message's first line (torch's and transformers' texts run over several)."""
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text.splitlines()[0][:200]}" if text else type(exc).__name__


class LazytrainError(Exception):
    """Base class: the CLI prints these as one clean line and exits non-zero."""


class TraceError(LazytrainError):
    """The model could not be captured into the IR (an untraceable construct, a bad model file)."""


class PlanError(LazytrainError):
    """A pass or the solver could not produce a valid plan."""


class InfeasibleBudget(PlanError):
    """No plan fits the GPU memory budget. Carries the smallest feasible budget in bytes, and whether
    the refusal holds whatever the token-wise work's tiles (`any_tiles`: the training state alone
    leaves the GPU more than the budget)."""

    def __init__(self, message: str, smallest_feasible: int, any_tiles: bool = False):
        super().__init__(message)
        self.smallest_feasible = smallest_feasible
        self.any_tiles = any_tiles


class VerifyError(PlanError):
    """The verifier found a broken event schedule (use before produce, use after free, memory)."""


class ScheduleMismatch(LazytrainError):
    """A schedule was bound to a model or batch it was not compiled for, or is corrupt or stale."""


class DataError(LazytrainError):
    """Training data is missing, empty, or does not fit the compiled shape or vocabulary."""


class CheckpointError(LazytrainError):
    """A checkpoint is corrupt, incomplete, or belongs to another model or run."""


class TrainingError(LazytrainError):
    """Training cannot go on safely: the weights are no longer finite."""


class ResourceError(LazytrainError):
    """The machine cannot provide what the plan needs (page-locked host memory, disk space)."""


class DistributedError(LazytrainError):
    """A collective across data-parallel ranks failed (a rank exited, failed, or stalled past the
    process group's timeout), or the ranks disagree on what they train."""
