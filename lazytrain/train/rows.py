"""The row file: training tokens in rows of ``seq_len`` on disk, written once, read a few rows at a
time.

One ``uint32`` word per token: the token id in bits 0-29, ``START`` (bit 30) where an example or
document starts inside a row (NOTE: [Packing] in packing.py), ``MASKED`` (bit 31) where its label
is -100; labels are otherwise the input ids themselves (the model shifts them). Beside it, two
``uint32`` per whole row: the padding at the row's end and the tokens it learns (labels not -100
after its first position, the ones the shifted loss counts), so a batch's honest token counts
need no read of its tokens (its sequences' lengths, which attention's FLOPs need, read the marks:
NOTE: [Model FLOPs] in flops.py).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from lazytrain.train.packing import WINDOW_ROWS, Layout, PackingStats, best_fit_decreasing

MASKED = np.uint32(1 << 31)
START = np.uint32(1 << 30)
ID_LIMIT = 1 << 30  # token ids must be below this
_ID = np.uint32(ID_LIMIT - 1)
IGNORE = -100  # the label Hugging Face's cross-entropy skips
_FLUSH_TOKENS = 1 << 18
META_FIELDS = 2  # per row: padding, learnt tokens


class RowWriter:
    """Appends documents and examples to the row file as ``layout`` says; only whole rows reach the
    file, so the row being filled can still be padded or dropped."""

    def __init__(self, path: Path, seq_len: int, eos: int, pad: int, layout: Layout):
        self._file = open(path, "wb")
        self._meta = open(meta_path(path), "wb")
        self.seq_len, self.eos, self.pad, self.layout = seq_len, eos, pad, layout
        self._parts: list[np.ndarray] = []
        self._held = 0  # tokens in _parts
        self.written = 0  # tokens in the file
        self.masked = False
        self._doc = 0  # tokens of the document being appended
        self._last = -1
        self._pads: dict[int, int] = {}  # row -> the padding that ends it, until the row is written
        self._window: list[np.ndarray] = []  # examples waiting to be packed
        self._window_tokens = 0
        self.stats = PackingStats()

    @property
    def tokens(self) -> int:
        return self.written + self._held

    def _append(self, words: np.ndarray) -> None:
        self._parts.append(words)
        self._held += words.size
        if self._held >= _FLUSH_TOKENS:
            self._flush(whole_rows=True)

    def _flush(self, whole_rows: bool) -> None:
        if not self._parts:
            return
        held = np.concatenate(self._parts)
        rows = held.size // self.seq_len
        n = rows * self.seq_len if whole_rows else held.size
        self._file.write(held[:n].tobytes())
        self._count_rows(held[: rows * self.seq_len].reshape(rows, self.seq_len))
        self.written += n
        self._parts = [held[n:]] if n < held.size else []
        self._held = held.size - n

    def _count_rows(self, rows: np.ndarray) -> None:
        """The side table's entries of whole rows about to be written."""
        first = self.written // self.seq_len
        pads = np.array([self._pads.pop(first + r, 0) for r in range(rows.shape[0])], dtype=np.uint32)
        learnt = ((rows[:, 1:] & MASKED) == 0).sum(axis=1).astype(np.uint32)
        self._meta.write(np.stack([pads, learnt], axis=1).tobytes())
        self.stats.rows += rows.shape[0]
        self.stats.slots += rows.size
        self.stats.padding += int(pads.sum())

    def extend(self, ids: list[int] | np.ndarray) -> None:
        """Part of the document being appended."""
        if not len(ids):
            return
        self._pack_window()
        words = np.asarray(ids, dtype=np.uint32)
        if self._doc == 0 and self.layout.mask_documents:
            words = words.copy()
            self._starts(words)
        self._append(words)
        self._doc += len(ids)
        self._last = int(ids[-1])

    def end_document(self) -> bool:
        """Close the document with eos (unless it is empty or ends with eos already)."""
        had = self._doc > 0
        if had and self._last != self.eos:
            self._append(np.array([self.eos], dtype=np.uint32))
        self._doc, self._last = 0, -1
        return had

    def _starts(self, words: np.ndarray) -> None:
        """``words`` begin a sequence: its first label is no target (inside a row it would be the
        previous sequence's), and inside a row it is marked where it starts."""
        words[0] |= MASKED
        self.masked = True
        if self.tokens % self.seq_len:
            words[0] |= START
            self.stats.separated = True

    def example(self, ids: np.ndarray, supervised: np.ndarray) -> str:
        """One example: "ok", "truncated", or skipped: "nothing" (no learnt token even whole) or
        "truncated_away" (none left in its first ``seq_len`` tokens). Packed with others of its
        window (NOTE: [Packing] in packing.py), or in a row of its own."""
        fill = self.tokens % self.seq_len
        if fill == 1:  # one packed token alone in a row teaches nothing: drop it
            self._drop_last()
        elif fill:
            self._pad(self.seq_len - fill)
        if not supervised[1:].any():  # the model shifts labels: position 0 is never predicted
            return "nothing"
        outcome = "ok"
        if ids.size > self.seq_len:
            ids, supervised, outcome = ids[: self.seq_len], supervised[: self.seq_len], "truncated"
            if not supervised[1:].any():
                return "truncated_away"
        words = ids.astype(np.uint32)
        words[~supervised] |= MASKED
        self.masked = self.masked or not supervised.all()
        self.stats.examples += 1
        self.stats.example_tokens += words.size
        if self.layout.pack_examples:
            self._window.append(words)
            self._window_tokens += words.size
            if self._window_tokens >= WINDOW_ROWS * self.seq_len:
                self._pack_window()
        else:
            self._row_of([words])
        return outcome

    def _pack_window(self) -> None:
        """The waiting examples into rows, best fit decreasing (NOTE: [Packing] in packing.py)."""
        if not self._window:
            return
        for row in best_fit_decreasing([w.size for w in self._window], self.seq_len):
            self._row_of([self._window[i] for i in row])
        self._window, self._window_tokens = [], 0

    def _row_of(self, examples: list[np.ndarray]) -> None:
        """A row of whole examples, padded to its end."""
        for words in examples:
            if self.layout.pack_examples:
                words = words.copy()
                self._starts(words)
            self._append(words)
        self._pad(self.seq_len - sum(w.size for w in examples))
        self.stats.example_rows += 1

    def _pad(self, n: int) -> None:
        if n:
            self._pads[self.tokens // self.seq_len] = n
            self._append(np.full(n, self.pad | MASKED, dtype=np.uint32))
            self.masked = True

    def _drop_last(self) -> None:
        self._flush(whole_rows=True)  # leaves exactly the partial row held
        self._parts = [np.concatenate(self._parts)[:-1]] if self._parts else []
        self._held -= 1

    def close(self) -> None:
        self._pack_window()
        self._flush(whole_rows=False)
        self._file.close()
        self._meta.close()

    def abort(self) -> None:
        """Close the files after a failure; what they still buffer is lost with the failed build."""
        for f in (self._file, self._meta):
            try:
                f.close()
            except OSError:  # its buffer's flush fails as the write did (a full disk)
                pass


def meta_path(path: Path) -> Path:
    return path.with_suffix(".rows")


def row_digest(path: Path, rows: int, seq_len: int, masked: bool) -> str:
    """A digest of the first ``rows`` rows; for data without masked labels it equals the
    sha256 of the int64 token rows, as it always has, so saved positions stay valid."""
    ids_hash, raw_hash = hashlib.sha256(), hashlib.sha256()
    remaining = rows * seq_len
    with open(path, "rb") as f:
        while remaining:
            n = min(remaining, _FLUSH_TOKENS)
            raw = np.frombuffer(f.read(4 * n), dtype=np.uint32)
            ids_hash.update((raw & ~MASKED).astype(np.int64).tobytes())
            raw_hash.update(raw.tobytes())
            remaining -= n
    return (raw_hash if masked else ids_hash).hexdigest()[:16]


class RowFile:
    """The rows of a row file, read a few at a time: ``rows`` whole rows of ``seq_len``."""

    def __init__(self, path: Path, seq_len: int, rows: int):
        self.seq_len, self.rows = seq_len, rows
        self.fd = os.open(path, os.O_RDONLY)
        self._meta = np.memmap(meta_path(path), dtype=np.uint32, mode="r", shape=(rows, META_FIELDS)) if rows \
            else np.zeros((0, META_FIELDS), dtype=np.uint32)
        self._arange = np.arange(seq_len)

    def close(self) -> None:
        os.close(self.fd)

    def words(self, rows: np.ndarray) -> np.ndarray:
        """These rows' words, [len(rows), seq_len] uint32, in order (runs of consecutive rows read
        together)."""
        size = 4 * self.seq_len
        words = [np.frombuffer(os.pread(self.fd, size * count, size * first), dtype=np.uint32)
                 for first, count in runs(rows)]
        return np.concatenate([np.zeros(0, dtype=np.uint32), *words]).reshape(-1, self.seq_len)

    def pads(self, rows: np.ndarray) -> np.ndarray:
        """The padding at the end of each of these rows."""
        return self._meta[rows, 0]

    def decode(self, raw: np.ndarray, pads: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Rows' words (``words``) and their ``pads``: ``(input_ids, labels, position_ids)``, int64."""
        ids = (raw & _ID).astype(np.int64)
        labels = np.where(raw & MASKED, IGNORE, ids)
        starts = (raw & START) != 0
        starts[:, 0] = True
        pads = pads.astype(np.int64)
        padded = np.flatnonzero(pads)
        starts[padded, self.seq_len - pads[padded]] = True  # the padding is a run of its own
        begun = np.maximum.accumulate(np.where(starts, self._arange, 0), axis=1)
        return ids, labels, self._arange - begun

    def counts(self, rows: np.ndarray) -> tuple[int, int]:
        """``(padding, learnt tokens)`` of these rows."""
        picked = self._meta[rows]
        return int(picked[:, 0].sum()), int(picked[:, 1].sum())


def sequence_lengths(raw: np.ndarray, pads: np.ndarray) -> np.ndarray:
    """The lengths, row by row, of the sequences of ``raw`` rows (row file words) whose padding is
    ``pads``: each starts at its row's start or a ``START`` mark and ends at the next one or where
    the row's padding begins (examples, documents, or a row's tokens whole where nothing marks a
    start in it: the runs ``decode``'s ``position_ids`` restart at 0, less the padding), so they
    sum to the rows' tokens that are no padding."""
    starts = (raw & START) != 0
    starts[:, 0] = True
    ends = raw.shape[1] - pads.astype(np.int64)
    row, col = np.nonzero(starts)
    keep = col < ends[row]
    row, col = row[keep], col[keep]
    same_row = np.append(row[1:] == row[:-1], False)
    return np.where(same_row, np.append(col[1:], 0), ends[row]) - col


def runs(rows: np.ndarray) -> list[tuple[int, int]]:
    """``rows`` as (first, count) runs of consecutive rows, read together; empty rows (-1) run too."""
    found: list[tuple[int, int]] = []
    for r in rows.tolist():
        last = found[-1] if found else None
        if last is not None and ((r < 0 and last[0] < 0) or (r >= 0 and last[0] >= 0 and sum(last) == r)):
            found[-1] = (last[0], last[1] + 1)
        else:
            found.append((r, 1))
    return found
