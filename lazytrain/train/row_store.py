"""Data files tokenised into a row file (``lazytrain.train.rows``) in a temporary directory that
goes with the object: what training batches (``data.PackedBatches``) and evaluation batches
(``evaluation.EvalSet``) read their rows from."""

from __future__ import annotations

import shutil
import tempfile
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lazytrain.errors import DataError
from lazytrain.train import records, tokens
from lazytrain.train.packing import Layout
from lazytrain.train.rows import IGNORE, RowFile, row_digest, runs, sequence_lengths
from lazytrain.train.tokenizers import check_vocab, eos_id, id_bound


@dataclass(frozen=True)
class Batch:
    """A batch of rows and what the global batch it belongs to holds: ``inputs`` (this rank's
    ``input_ids``, ``labels``, ``position_ids``), the global batch's ``slots`` (rows x seq_len),
    ``tokens`` (slots that are no padding), ``learnt`` (labels the shifted loss counts) and
    ``documents`` (the lengths of the sequences its attention keeps apart, read-only; they sum to
    ``tokens``: NOTE: [Model FLOPs] in flops.py)."""

    inputs: dict[str, torch.Tensor]
    slots: int
    tokens: int
    learnt: int
    documents: np.ndarray

    @property
    def pad_fraction(self) -> float:
        return 1 - self.tokens / self.slots


class RowStore:
    """``paths`` (as ``records.find_inputs`` takes them) tokenised with ``tokenizer`` into rows of
    ``seq_len`` laid out as ``layout`` says, in a temporary directory under ``workdir`` (default:
    the system's) that is removed with this object. ``what`` names the data in errors."""

    def __init__(self, paths: str | Path | Sequence[str | Path], tokenizer, seq_len: int, *, layout: Layout,
                 vocab_size: int | None = None, workdir: str | Path | None = None, what: str = "the training data"):
        if vocab_size is not None:
            check_vocab(tokenizer, vocab_size)
        vocab_bound = int(vocab_size) if vocab_size is not None else id_bound(tokenizer)
        eos = eos_id(tokenizer)
        pad = getattr(tokenizer, "pad_token_id", None)
        self.pad = eos if pad is None else int(pad)
        inputs = records.find_inputs(paths)
        self.seq_len, self.layout = seq_len, layout
        self._dir = Path(tempfile.mkdtemp(prefix="lazytrain-data-", dir=workdir))
        self._cleanup = weakref.finalize(self, _release, self._dir, None)
        try:
            built = tokens.build_rows(inputs, tokenizer, seq_len, vocab_bound, eos, self.pad, self._dir, layout)
        except BaseException:
            self._cleanup()
            raise
        self.stats, self.packing, self.num_tokens = built.stats, built.packing, built.tokens
        self.names = ", ".join(str(i.path) for i in inputs)
        if built.tokens == 0:
            self._cleanup()
            if built.stats.skipped:
                raise DataError(built.stats.nothing_learnt(seq_len, self.names))
            raise DataError(f"{what} has no tokens (all documents are empty): {self.names}; pass files "
                            "with text in them")
        self.rows = built.tokens // seq_len
        # Binds a saved position to this exact token stream (data, tokenizer, seq_len and layout).
        self.digest = row_digest(built.path, self.rows, seq_len, built.masked)
        self.file = RowFile(built.path, seq_len, self.rows)
        self._cleanup.detach()
        self._cleanup = weakref.finalize(self, _release, self._dir, self.file)

    def close(self) -> None:
        """Delete the row file now (it also goes when this object is collected)."""
        self._cleanup()

    def batch(self, rows: np.ndarray, mine: slice) -> Batch:
        """The batch of global ``rows`` (indices; -1: an empty row, all padding, nothing learnt), of
        which this rank reads ``mine``."""
        real = rows[rows >= 0]
        # every rank's rows, read once: the global batch's sequences, as the counts, and this rank's inputs
        raw, pads = self.file.words(real), self.file.pads(real)
        documents = sequence_lengths(raw, pads)
        documents.flags.writeable = False
        at = np.cumsum(rows >= 0) - 1  # each real row's place in raw
        parts, position = [], range(len(rows))[mine].start
        for first, count in runs(rows[mine]):
            if first < 0:
                empty = np.full((count, self.seq_len), self.pad, dtype=np.int64)
                parts.append((empty, np.full_like(empty, IGNORE), np.tile(np.arange(self.seq_len), (count, 1))))
            else:
                i = at[position]
                parts.append(self.file.decode(raw[i : i + count], pads[i : i + count]))
            position += count
        padding, learnt = self.file.counts(real)
        slots = rows.size * self.seq_len
        inputs = {name: torch.from_numpy(np.concatenate([p[i] for p in parts]))
                  for i, name in enumerate(("input_ids", "labels", "position_ids"))}
        return Batch(inputs, slots, slots - padding - (rows.size - real.size) * self.seq_len, learnt, documents)


def _release(directory: Path, file: RowFile | None) -> None:
    if file is not None:
        file.close()
    shutil.rmtree(directory, ignore_errors=True)
