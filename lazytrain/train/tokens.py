"""Training records to rows of tokens in a file on disk.

``build_rows`` tokenises every input, in order, into the row file (``lazytrain.train.rows``),
written in whole rows of ``seq_len``, so host memory stays bounded whatever the corpus size.

NOTE: [Packing and masking]
* Documents (``.txt`` documents, ``{"text"}`` records, ``{"input_ids"}`` records without labels)
  are concatenated: each one's tokens and an end-of-text token are appended to the stream, which
  is cut into rows; each document attends to itself alone unless the layout lets attention cross
  them, as in usual pre-training.
* Examples (``{"prompt", "completion"}``, ``{"messages"}``, ``{"input_ids", "labels"}``) are
  truncated to ``seq_len`` and packed whole, several to a row, or (``--packing off``) each starts
  a row of its own, padded to its end. Labels are -100 on padding, prompt and non-assistant
  tokens, and at the first token of every sequence that does not start its row.
How the sequences of a row are kept apart: NOTE: [Packing] in packing.py.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from lazytrain.errors import DataError, LazytrainError, ResourceError
from lazytrain.files import free_bytes, is_disk_full
from lazytrain.train import records as rec
from lazytrain.train.chat import chat_example
from lazytrain.train.data_stats import Stats
from lazytrain.train.packing import Layout, PackingStats
from lazytrain.train.rows import ID_LIMIT, IGNORE, RowWriter
from lazytrain.units import format_size

PIECE_CHARS = 1 << 16  # the longest text handed to the tokenizer in one piece
BATCH_CHARS = 1 << 19  # text tokenised per call (the tokenizer's parallel batch)
BATCH_ROWS = 256  # records read per batch


@dataclass(frozen=True)
class Rows:
    """The token file: ``tokens`` written (whole rows, plus a tail that fills no row)."""

    path: Path
    tokens: int
    masked: bool  # some label is -100 (else labels equal input_ids everywhere)
    stats: Stats
    packing: PackingStats  # what the whole rows hold


# --------------------------------------------------------------------------- records


def _ids(value: Any, field: str, where: str, bound: int, allow_ignore: bool = False) -> np.ndarray:
    """A list of token ids from a record, checked: integers (a JSON reader may give integral
    floats) in ``[0, bound)``, or -100 where ``allow_ignore``."""
    fix = "tokenise the data with the model's tokenizer"
    if not isinstance(value, (list, tuple)):
        raise DataError(f'{where}: "{field}" must be a list of integers')
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        raise DataError(f'{where}: "{field}" must be a list of integers')
    values = np.asarray(value, dtype=np.float64 if any(isinstance(v, float) for v in value) else np.int64)
    if values.dtype == np.float64:
        bad = ~np.isfinite(values) | (values != np.round(values))
        if bad.any():
            raise DataError(
                f'{where}: "{field}" must be a list of integers, but holds {float(values[bad][0])}'
                f"; {fix}"
            )
    ok = (values >= 0) & (values < bound)
    if allow_ignore:
        ok |= values == IGNORE
    if not ok.all():
        bad_value = value[int(np.argmin(ok))]
        raise DataError(
            f"{where}: token id {bad_value} is outside the vocab (valid ids are 0..{bound - 1}"
            f"{' and -100' if allow_ignore else ''}); {fix}"
        )
    return values.astype(np.int64)


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens, through the Rust backend when there is
    one: it batches in parallel and skips transformers' warning about long documents."""
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
        return [enc.ids for enc in encode(texts, add_special_tokens=False)]
    return [list(tokenizer.encode(text, add_special_tokens=False)) for text in texts]


# --------------------------------------------------------------------------- building


class _Builder:
    def __init__(self, writer: RowWriter, tokenizer, vocab_bound: int):
        self.writer, self.tokenizer, self.bound = writer, tokenizer, vocab_bound
        self.stats = Stats()
        self._pending: list[tuple[Callable[[list[list[int]]], None], list[str]]] = []
        self._chars = 0

    def later(self, texts: list[str], then: Callable[[list[list[int]]], None]) -> None:
        """Tokenise ``texts`` with the next batch, then call ``then`` with their ids, in order."""
        self._pending.append((then, texts))
        self._chars += sum(len(t) for t in texts)
        if self._chars >= BATCH_CHARS:
            self.flush()

    def flush(self) -> None:
        texts = [t for _, group in self._pending for t in group]
        encoded = iter(_encode(self.tokenizer, texts))
        for then, group in self._pending:
            then([next(encoded) for _ in group])
        self._pending, self._chars = [], 0

    def example(self, ids: np.ndarray, supervised: np.ndarray, chat_without_assistant: bool = False) -> None:
        outcome = self.writer.example(ids, supervised)
        self.stats.examples += outcome in ("ok", "truncated")
        self.stats.truncated += outcome in ("truncated", "truncated_away")
        self.stats.truncated_away += outcome == "truncated_away"
        self.stats.nothing_to_learn += outcome == "nothing"
        self.stats.no_assistant += outcome == "nothing" and chat_without_assistant

    def document(self, pieces: Iterator[tuple[str, bool]]) -> None:
        """Packed documents from ``(piece, ends_document)``, a bounded batch of text at a time."""
        def then(ends: bool) -> Callable[[list[list[int]]], None]:
            def append(ids: list[list[int]]) -> None:
                self.writer.extend(ids[0])
                if ends:
                    self.stats.documents += self.writer.end_document()
            return append

        for text, ends in pieces:
            self.later([text], then(ends))

    def add_txt(self, path: Path) -> None:
        self.document(rec.text_pieces(path, PIECE_CHARS))
        self.flush()

    def add_record(self, record: dict, where: Callable[[], str], seq_len: int, one: rec.OneFormat) -> None:
        try:
            kind = rec.record_format(record, "")
        except DataError:  # worded again with the location only now: finding a line scans
            kind = rec.record_format(record, where())
        one.check(kind, where)
        if kind is rec.Format.TEXT:
            self.document(rec.pieces(record["text"], PIECE_CHARS))
        elif kind is rec.Format.INSTRUCTION:
            def then(ids: list[list[int]]) -> None:
                prompt, completion = ids
                tokens = np.asarray(prompt + completion + [self.writer.eos], dtype=np.int64)
                supervised = np.arange(tokens.size) >= len(prompt)
                self.example(tokens, supervised)
            self.later([record["prompt"], record["completion"]], then)
        elif kind is rec.Format.CHAT:
            self.flush()  # keep the records' order
            alone = not any(m.get("role") == "assistant" for m in record["messages"])
            self.example(*chat_example(self.tokenizer, record["messages"], where), chat_without_assistant=alone)
        else:
            self.flush()
            self._ids_record(record, where, seq_len)

    def _ids_record(self, record: dict, where: Callable[[], str], seq_len: int) -> None:
        raw, labels = record["input_ids"], record.get("labels")
        try:
            ids = _ids(raw, "input_ids", "", self.bound)
            checked = None if labels is None else _ids(labels, "labels", "", self.bound, True)
        except DataError as exc:  # named with the line only now: finding it scans the file
            raise DataError(f"{where()}{exc}") from None
        if ids.size > seq_len:
            raise DataError(
                f"{where()}: sequence of {ids.size} tokens is longer than the compiled shape's "
                f"seq_len {seq_len}; split the record or compile with a larger seq_len"
            )
        if checked is None:
            self.writer.extend(ids)
            self.stats.documents += self.writer.end_document()
            return
        if checked.size != ids.size or not np.all((checked == ids) | (checked == IGNORE)):
            raise DataError(
                f'{where()}: "labels" must have one entry per input id, each equal to that '
                "input id or -100 (the model shifts labels itself)"
            )
        self.example(ids, checked != IGNORE)


def build_rows(
    inputs: list[rec.Input], tokenizer, seq_len: int, vocab_bound: int, eos: int, pad: int,
    workdir: Path, layout: Layout,
) -> Rows:
    """Tokenise ``inputs`` in order into ``workdir/tokens.u32`` laid out as ``layout`` says (see
    NOTE: [Packing and masking]); raises ``DataError`` naming the file and line of any unusable
    record, and ``ResourceError`` naming the token file if its disk fills."""
    if vocab_bound > ID_LIMIT:
        raise DataError(f"a vocabulary of {vocab_bound} ids is past the {ID_LIMIT} the token file holds; use a "
                        "tokenizer and model with fewer ids")
    path = workdir / "tokens.u32"
    writer = RowWriter(path, seq_len, eos, pad, layout)
    builder = _Builder(writer, tokenizer, vocab_bound)
    try:
        for inp in inputs:
            if inp.kind == "text":
                builder.add_txt(inp.path)
                continue
            one = rec.OneFormat()
            for first, columns in rec.record_batches(
                inp, BATCH_ROWS, workdir / "datasets-cache", rec.OneFormat().check_record
            ):
                for i, record in enumerate(_rows_of(columns)):
                    where = lambda inp=inp, row=first + i: rec.where(inp, row)  # noqa: E731
                    builder.add_record(record, where, seq_len, one)
            builder.flush()
        writer.close()
    except BaseException as exc:
        writer.abort()
        if isinstance(exc, Exception) and not isinstance(exc, LazytrainError) and is_disk_full(exc):
            raise _disk_full(path, writer.written) from None
        raise
    return Rows(path, writer.tokens, writer.masked, builder.stats, writer.stats)


def _disk_full(path: Path, written: int) -> ResourceError:
    free = free_bytes(path)
    has = f", {format_size(free)} free" if free is not None else ""
    return ResourceError(
        f"no space left on the disk to write the token file {path}: it had written {format_size(4 * written)} "
        f"({written} tokens at 4 bytes each) when the disk filled{has}; set TMPDIR to a directory on a disk "
        "with room for 4 bytes a token of the training data, or free space on that disk"
    )


def _rows_of(columns: dict[str, list]) -> Iterator[dict]:
    names = list(columns)
    for values in zip(*(columns[n] for n in names)):
        yield dict(zip(names, values))
