"""Finiteness of the tensors a run starts from and saves.

NOTE: [Finite state]
A non-finite weight or moment makes every later step non-finite, and the first sign of it, a step's
loss, says nothing of where it came from. So the state is checked where it enters and leaves a run:
a checkpoint on resume (resume_checks.py names its first non-finite tensor; the sharded layout's
moments, read only once the trainer is bound, `check_restored`), a model directory's
weights once loaded (`check_loaded`, from loop.py), and the weights and optimizer state of every save,
before anything is written, so LATEST never names a diverged state (`refuse_nonfinite`, from loop.py's
`_save` and dist_checkpoint.save): the newest good checkpoint stays the one to resume from. Each
check is one pass over the tensors, in slices of `_SLICE` elements, so it needs no memory of a
tensor's size.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator
from typing import Any

import torch

from lazytrain.errors import CheckpointError, DataError, TrainingError
from lazytrain.train.checkpoint import LATEST_FILE
from lazytrain.train.dist_checkpoint import SHARDED

_SLICE = 1 << 24


def nonfinite(t: Any) -> str | None:
    """"nan", "inf" or "-inf": the first non-finite value of floating tensor `t` (a DTensor: this
    rank's piece), or None when it holds none (or is no floating tensor, or has no storage)."""
    if not torch.is_tensor(t) or not t.is_floating_point() or t.is_meta:
        return None
    local = t.to_local() if hasattr(t, "to_local") else t
    flat = local.detach().reshape(-1)  # a view: state tensors are contiguous
    for lo in range(0, flat.numel(), _SLICE):
        piece = flat[lo:lo + _SLICE]
        finite = torch.isfinite(piece)
        if not bool(finite.all()):
            value = piece[~finite][0].item()
            return "nan" if math.isnan(value) else "inf" if value > 0 else "-inf"
    return None


def first_nonfinite(named: Iterable[tuple[str, Any]]) -> tuple[str, str] | None:
    """(label, kind) of the first tensor of `named` holding a non-finite value, or None."""
    for label, t in named:
        kind = nonfinite(t)
        if kind is not None:
            return label, kind
    return None


def param_names(schedule) -> list[str]:
    """The model's names of the optimizer's parameters, in its order (one group per stage, then the
    shared parameters)."""
    params = [p for stage in schedule.STAGES for p in stage.params] + list(schedule.SHARED)
    return [schedule.PLACEHOLDERS[p][1] for p in params]


def labelled_state(model_state: dict, optimizer_state: dict, names: list[str]) -> Iterator[tuple[str, Any]]:
    """Every entry of a checkpoint's weights and optimizer state (torch.optim's format, its entries by
    index into `names`, or the sharded layout's by name: NOTE: [Distributed checkpoints]) with a label
    for messages, e.g. "the optimizer's exp_avg of model.embed_tokens.weight"."""
    yield from model_state.items()
    optimizer = optimizer_state.get(SHARDED, optimizer_state) if isinstance(optimizer_state, dict) else {}
    entries = optimizer.get("state") if isinstance(optimizer, dict) else None
    for who, entry in (entries.items() if isinstance(entries, dict) else ()):
        param = names[who] if isinstance(who, int) and 0 <= who < len(names) else str(who)
        for key, value in _leaves(entry):
            yield f"the optimizer's {key} of {param}", value


def _leaves(entry) -> Iterator[tuple[str, Any]]:
    """(key, value) of a parameter's state, nested dicts flattened (bitsandbytes wraps its 8-bit
    state in one)."""
    for key, value in entry.items() if isinstance(entry, dict) else ():
        if isinstance(value, dict):
            yield from _leaves(value)
        else:
            yield key, value


def refuse_nonfinite(step: int, named: Iterable[tuple[str, Any]], what: str = "checkpoint") -> None:
    """Raise `TrainingError` before the save (or the export: `what`) of `step` when a tensor it would
    write is not finite (NOTE: [Finite state])."""
    found = first_nonfinite(named)
    if found is not None:
        label, kind = found
        raise TrainingError(
            f"step {step}: {label} holds {kind}: training diverged, so no {what} of step {step} is written and "
            "the newest checkpoint stays the latest; lower --lr or --weight-decay and train again (or resume from the "
            "newest checkpoint with --new-lr-schedule and a lower --lr)")


def check_loaded(model: torch.nn.Module, origin) -> None:
    """Raise `DataError` when a weight loaded from `origin` (a model directory's weights) is not finite."""
    found = first_nonfinite(model.state_dict().items())
    if found is not None:
        name, kind = found
        raise DataError(f"weights {origin} hold {kind} in {name}: they were saved from a diverged run or are damaged; "
                        "pass weights whose values are finite (an earlier checkpoint of that model, or --weights "
                        "random)")


def diverged(path, label: str, kind: str) -> CheckpointError:
    """The refusal of the checkpoint at `path`, whose `label` holds `kind` (nan, inf, -inf)."""
    return CheckpointError(f"checkpoint {path} holds {kind} in {label}: the run had diverged when it was saved; delete "
                           f"it (and {path.parent / LATEST_FILE} if it names it) to resume from the previous one")


def check_restored(trainer, path) -> None:
    """Raise `CheckpointError` when a moment `trainer` read from the checkpoint at `path` after it was
    bound (the sharded layout's: NOTE: [Distributed checkpoints] in dist_checkpoint.py) is not finite:
    this rank's pieces, once every collective of the restore is done."""
    names = {id(home): trainer.m.PLACEHOLDERS[p][1] for p, home in trainer.store.home.items()}
    found = first_nonfinite((f"the optimizer's {key} of {names.get(id(home), 'a parameter')}", t)
                            for home, entry in trainer.optimizer.state.items() for key, t in entry.items()
                            if key in ("exp_avg", "exp_avg_sq"))
    if found is not None:
        raise diverged(path, *found)
