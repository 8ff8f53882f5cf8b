"""Held-out loss during training (``--eval-data``, ``--eval-every``, ``--eval-steps``).

NOTE: [Evaluation through the training step]
The step is compiled for one batch shape and run by the trainer, so an evaluation runs the same
compiled stages: ``Trainer.loss``, their forwards alone without autograd, within the plan's memory
(NOTE: [Forward-only evaluation] in runtime/forward_only.py; on several ranks or with the master
weights on disk the whole step, its gradients discarded). Nothing it does reaches training: pending updates are applied
first (``synchronize``, as a checkpoint does), no gradient outlives a batch, and the random-number generators are put back as they were (a model
with dropout draws in forward), while the optimizer, the LR schedule and the data position are
never touched; so a run with evaluations trains exactly as one without. The eval set is laid out
as the training data (NOTE: [Packing] in packing.py) and read in file order from its start every
time, so successive evaluations are comparable; a last batch the rows do not fill is completed
with empty rows (padding, nothing learnt). The loss is the mean over every learnt token of the
batches evaluated: each batch's mean (the global batch's, on several ranks) weighted by its count
of learnt tokens. Dropout stays as compiled (training mode). On one process a batch costs its
forward: 2N of a training step's 6N FLOPs a token.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lazytrain.errors import DataError
from lazytrain.train.packing import Layout
from lazytrain.train.row_store import Batch, RowStore

MAX_BATCHES = 50  # an evaluation without --eval-steps reads the whole eval set, at most this many batches


class EvalSet:
    """The ``--eval-data`` rows, read as batches of ``batch_size`` (this rank's share, as training
    reads them) in file order: ``steps`` of them (default: the whole set, at most ``MAX_BATCHES``;
    never past its end)."""

    def __init__(self, paths: str | Path | Sequence[str | Path], tokenizer, batch_size: int, seq_len: int, *,
                 layout: Layout, steps: int | None = None, vocab_size: int | None = None, rank: int = 0,
                 world: int = 1, workdir: str | Path | None = None):
        self._store = RowStore(paths, tokenizer, seq_len, layout=layout, vocab_size=vocab_size, workdir=workdir,
                               what="the eval data")
        self.stats, self.packing = self._store.stats, self._store.packing
        if not self._store.rows:
            self._store.close()
            raise DataError(f"the eval data {self._store.names} has {self._store.num_tokens} tokens, less than one "
                            f"row of {seq_len}; add held-out data")
        self.batch_size, self.seq_len = batch_size, seq_len
        share = batch_size // world
        self._mine = slice(rank * share, (rank + 1) * share)
        self.total = max(1, math.ceil(self._store.rows / batch_size))
        self.steps = min(steps or MAX_BATCHES, self.total)

    @property
    def separated(self) -> bool:
        return self.packing.separated

    def close(self) -> None:
        self._store.close()

    def batches(self) -> Iterator[Batch]:
        for b in range(self.steps):
            rows = np.arange(b * self.batch_size, (b + 1) * self.batch_size)
            rows[rows >= self._store.rows] = -1  # past the end: empty rows
            yield self._store.batch(rows, self._mine)

    def describe(self) -> str:
        """The line a run prints once about its evaluations."""
        whole = "the whole eval set" if self.steps == self.total else \
            f"{self.steps} of its {self.total} (--eval-steps to change)"
        return (f"eval: {self._store.rows} rows of {self.seq_len} tokens from {self._store.names}, "
                f"{self.steps} batch{'es' if self.steps > 1 else ''} an evaluation ({whole})")


@dataclass(frozen=True)
class Evaluation:
    loss: float  # the mean over the learnt tokens of the batches evaluated
    learnt: int
    batches: int


def evaluate(trainer, eval_set: EvalSet, feed) -> Evaluation:
    """The eval set's loss through the trainer's compiled step, training's state untouched (NOTE:
    [Evaluation through the training step]); ``feed(batch)`` gives the step's inputs of a batch."""
    trainer.synchronize()
    timing, trainer.record_timeline = trainer.record_timeline, False
    devices = [trainer.device] if trainer.device.type == "cuda" else []
    total, learnt, batches = 0.0, 0, 0
    with torch.random.fork_rng(devices=devices, device_type=trainer.device.type):
        for batch in eval_set.batches():
            if not batch.learnt:  # nothing learnt in the whole global batch: its mean is no number
                continue
            loss = trainer.loss(feed(batch)).item()
            total += loss * batch.learnt
            learnt += batch.learnt
            batches += 1
    trainer.record_timeline = timing
    return Evaluation(total / learnt if learnt else math.nan, learnt, batches)
