"""Training data: packed batches that can be resumed exactly.

``PackedBatches`` turns the ``--data`` inputs (``.txt``, ``.jsonl``/``.json``/``.parquet``
records, a saved ``datasets`` directory) into an endless stream of fixed-shape batches
``{"input_ids", "labels", "position_ids"}`` of ``[batch_size, seq_len]`` int64 tensors, which is
the only shape a compiled training step accepts. The inputs are tokenised once into rows of
``seq_len`` tokens in a file on disk (``lazytrain.train.tokens``: documents concatenated with
end-of-text tokens between them, examples packed whole several to a row or one padded row each,
labels -100 outside what is learnt; NOTE: [Packing] in packing.py). Every epoch reads the rows in
a permutation drawn from ``(seed, epoch)`` (``shuffle=False``: in file order), so the whole
sequence of batches is a pure function of the data, ``seq_len``, the layout, ``seed`` and the
order. ``state_dict()`` is the position in that sequence, so a resumed run yields exactly the
batches an uninterrupted run would have.

NOTE: [Epoch order] Positions saved before epoch 0 was shuffled (no ``shuffle_from`` in the state)
read epoch 0 in file order and later epochs permuted; they resume so, as the run began.

NOTE: [Data across ranks]
On several ranks every rank tokenises the same inputs and walks the same sequence of global
batches (the same permutations, from the same seed); rank r of N takes rows r·B/N to (r+1)·B/N of
each global batch of B rows, so the N ranks together train on exactly the batch one process would.
The position (``state_dict()``) counts global rows, the same on every rank, so a checkpoint of any
world size resumes at any other that divides B.

Every problem with the data is a ``DataError`` that names the file (and line) and the fix.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lazytrain.errors import DataError
from lazytrain.train import records
from lazytrain.train.packing import Layout
from lazytrain.train.row_store import Batch, RowStore
from lazytrain.train.tokenizers import (  # noqa: F401 -- where callers have always found them
    CORPUS_PATH, EOS_TOKEN, PAD_TOKEN, TOKENIZER_PATH, builtin_tokenizer, check_vocab, load_tokenizer,
)

SUFFIXES = records.SUFFIXES
_STATE_VERSION = 1
_ORDERS = (0, 1, None)  # the first permuted epoch: every one, all but epoch 0 (NOTE: [Epoch order]), none

# --------------------------------------------------------------------------- batches


class PackedBatches:
    """An endless, resumable iterator of packed ``[batch_size, seq_len]`` batches.

    ``paths``: a data file, a directory of them or a saved dataset, or a sequence of these (the
    formats: ``records.FORMATS``). ``vocab_size``: the model's vocabulary; defaults to the
    tokenizer's. Pre-tokenised ids at or above it are rejected (a larger tokenizer is rejected
    through ``check_vocab``). ``workdir``: where the token file goes (a temporary directory
    under it, removed with this object); the system's temporary directory by default.

    Each document contributes its tokens followed by one eos (a pre-tokenised record that
    already ends with eos gets no second one; empty documents contribute nothing); examples
    are packed whole or take a padded row each, as ``layout`` says (NOTE: [Packing] in
    packing.py). A batch takes the next ``batch_size`` rows and continues into the next epoch
    when the current one runs out, so no row is skipped. Batches are fresh tensors; ``labels``
    equals ``input_ids`` (the model shifts them) except for -100 where nothing is learnt, and
    ``position_ids`` restart at 0 where a sequence (or a row's padding) starts.
    ``next_batch()`` also says what the global batch holds (``row_store.Batch``).

    ``rank`` of ``world``: each batch is this rank's share of the global one, ``batch_size / world``
    rows (NOTE: [Data across ranks]); ``world`` must divide ``batch_size``.

    ``shuffle``: every epoch reads the rows in a permutation drawn from ``(seed, epoch)``, the same
    on every rank; ``False`` reads them in file order.
    """

    def __init__(
        self,
        paths: str | Path | Sequence[str | Path],
        tokenizer,
        batch_size: int,
        seq_len: int,
        *,
        seed: int = 0,
        vocab_size: int | None = None,
        workdir: str | Path | None = None,
        rank: int = 0,
        world: int = 1,
        shuffle: bool = True,
        layout: Layout = Layout(),
    ):
        if batch_size < 1 or seq_len < 1:
            raise DataError(
                f"batch_size and seq_len must be positive, got batch_size={batch_size}, "
                f"seq_len={seq_len}"
            )
        if world < 1 or not 0 <= rank < world or batch_size % world:
            raise DataError(
                f"a global batch of {batch_size} rows cannot be split over {world} ranks (rank {rank}); "
                f"pass a batch size that is a multiple of the number of ranks"
            )
        self.rank, self.world = int(rank), int(world)
        self.batch_size = int(batch_size)
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        self.layout = layout
        self._shuffle_from = 0 if shuffle else None  # the first epoch read permuted (NOTE: [Epoch order])
        self._store = RowStore(paths, tokenizer, self.seq_len, layout=layout, vocab_size=vocab_size, workdir=workdir)
        self.stats, self.packing = self._store.stats, self._store.packing
        need = self.batch_size * self.seq_len
        if self._store.num_tokens < need:
            self._store.close()
            raise DataError(
                f"the training data has {self._store.num_tokens} tokens but one batch of "
                f"{self.batch_size} x {self.seq_len} needs {need}; add data or use a smaller "
                "batch_size or seq_len"
            )
        self.num_tokens = self._store.num_tokens
        self.data_digest = self._store.digest
        # the layout as far as this data is concerned: a position binds it (packing text alone packs nothing)
        self._laid_out = Layout(layout.pack_examples and self.stats.examples > 0,
                                layout.mask_documents and self.stats.documents > 0)
        self._epoch = 0
        self._row = 0
        self._order_epoch = -1
        self._order: np.ndarray | None = None

    def close(self) -> None:
        """Delete the token file now (it also goes when this object is collected)."""
        self._store.close()

    # ---------------------------------------------------------------- sizes

    @property
    def rows_per_epoch(self) -> int:
        """Rows of ``seq_len`` tokens in one pass over the data."""
        return self._store.rows

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def epoch(self) -> int:
        """The epoch the next batch starts in."""
        return self._epoch

    @property
    def separated(self) -> bool:
        """Some row holds sequences that must not see each other: the model needs ``position_ids``."""
        return self.packing.separated

    # ---------------------------------------------------------------- iteration

    def _epoch_order(self, epoch: int) -> np.ndarray | None:
        """Row order of ``epoch``: a seeded permutation, or None (file order) without shuffling."""
        if self._shuffle_from is None or epoch < self._shuffle_from:
            return None
        if self._order_epoch != epoch:
            generator = torch.Generator()
            # Distinct (seed, epoch) pairs give distinct 63-bit seeds for any realistic values.
            generator.manual_seed((self.seed * 1_000_003 + epoch) % (2**63))
            self._order = torch.randperm(self.rows_per_epoch, generator=generator).numpy()
            self._order_epoch = epoch
        return self._order

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        return self.next_batch().inputs

    def next_batch(self) -> Batch:
        """The next batch, with what its global batch holds."""
        rows = []
        while sum(r.size for r in rows) < self.batch_size:
            take = min(self.batch_size - sum(r.size for r in rows), self.rows_per_epoch - self._row)
            order = self._epoch_order(self._epoch)
            span = slice(self._row, self._row + take)
            rows.append(np.arange(span.start, span.stop) if order is None else order[span])
            self._row += take
            if self._row == self.rows_per_epoch:
                self._epoch += 1
                self._row = 0
        share = self.batch_size // self.world  # this rank's rows of the global batch
        return self._store.batch(np.concatenate(rows), slice(self.rank * share, (self.rank + 1) * share))

    # ---------------------------------------------------------------- resume

    def state_dict(self) -> dict[str, Any]:
        """The position of the next batch; JSON-serialisable (it goes into checkpoint meta)."""
        return {
            "version": _STATE_VERSION,
            "epoch": self._epoch,
            "row": self._row,
            "seed": self.seed,
            "shuffle_from": self._shuffle_from,
            "seq_len": self.seq_len,
            "rows_per_epoch": self.rows_per_epoch,
            "data_digest": self.data_digest,
            **self._laid_out.state(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position saved by ``state_dict()``.

        The saved seed and order are adopted, since they are part of the position. Raises ``DataError`` if
        the state was saved over different data, tokenizer, ``seq_len`` or layout: the same
        position would then name different tokens. ``batch_size`` may differ; the position is in rows.
        """
        try:
            version, epoch, row = state["version"], int(state["epoch"]), int(state["row"])
            saved = (state["seq_len"], state["rows_per_epoch"], state["data_digest"])
            seed = int(state["seed"])
            order = state.get("shuffle_from", 1)  # NOTE: [Epoch order]
            if order not in _ORDERS:
                raise ValueError(f"shuffle_from {order!r}")
            layout = Layout.of_state(state)
        except (KeyError, TypeError, ValueError) as exc:
            raise DataError(
                f"data position {state!r} is not a PackedBatches state ({exc}); pass the dict "
                "returned by PackedBatches.state_dict()"
            ) from exc
        if version != _STATE_VERSION:
            raise DataError(
                f"data position has version {version}, this lazytrain reads version "
                f"{_STATE_VERSION}; resume with the lazytrain that wrote it"
            )
        if layout != self._laid_out:
            raise DataError(
                f"the saved data position was laid out with {layout.flags()}, this run lays the data out with "
                f"{self._laid_out.flags()}; resume with {layout.fix(self._laid_out)}, or start a fresh run"
            )
        ours = (self.seq_len, self.rows_per_epoch, self.data_digest)
        if tuple(saved) != ours:
            raise DataError(
                f"the saved data position was taken over different data (seq_len, rows, digest "
                f"{tuple(saved)} vs now {ours}); resume with the same data files, tokenizer and "
                "seq_len, or start a fresh run"
            )
        if epoch < 0 or not 0 <= row < self.rows_per_epoch:
            raise DataError(
                f"data position epoch={epoch}, row={row} is out of range for "
                f"{self.rows_per_epoch} rows per epoch; the state is corrupt"
            )
        self.seed, self._epoch, self._row, self._shuffle_from = seed, epoch, row, order
        self._order_epoch, self._order = -1, None


def builtin_batches(batch_size: int, seq_len: int, seed: int = 0, shuffle: bool = True,
                    layout: Layout = Layout()) -> PackedBatches:
    """``PackedBatches`` over the shipped corpus with the shipped tokenizer."""
    return PackedBatches([CORPUS_PATH], builtin_tokenizer(), batch_size, seq_len, seed=seed, shuffle=shuffle,
                         layout=layout)
