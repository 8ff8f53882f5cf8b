"""Reading training inputs: which files, the text pieces of a ``.txt``, the records of a table and
the format each is in.

Plain text is read here in bounded pieces; every other format is read through the ``datasets``
library, streamed (JSON and Parquet) or memory-mapped (a ``save_to_disk`` directory), so no input
is ever held whole in memory. JSON lines are checked first (``lazytrain.train.json_lines``: NOTE:
[Pathological JSON], NOTE: [Record size]). Records come out in batches of Python columns; which
``Format`` each is in is decided here, and a file keeps one (``OneFormat``); what they mean is
``lazytrain.train.tokens``' business.
"""

from __future__ import annotations

import contextlib
import enum
import logging
import re
import stat
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from lazytrain.errors import DataError
from lazytrain.files import is_disk_full
from lazytrain.train.json_lines import READ_BYTES, check_json_lines, is_json_array, json_line_of, locate_json_error

TEXT_SUFFIXES = (".txt",)
TABLE_SUFFIXES = (".jsonl", ".json", ".parquet")
SUFFIXES = TEXT_SUFFIXES + TABLE_SUFFIXES
FIELDS = ("text", "input_ids", "labels", "prompt", "completion", "messages")
FORMATS = (
    ".txt (blank lines separate documents), .jsonl/.json/.parquet records, or a directory saved "
    "with datasets' save_to_disk()"
)
# A blank line (only whitespace) between two lines separates documents; several count as one.
_DOC_SEPARATOR = re.compile(r"\n(?:[^\S\n]*\n)+")
_SPACE_BEFORE_WORD = re.compile(r"\s(?=\S)")
# What a path that is neither a regular file nor a directory is, by its st_mode test.
_SPECIAL = ((stat.S_ISFIFO, "a FIFO (named pipe)"), (stat.S_ISSOCK, "a socket"),
            (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"))


@dataclass(frozen=True)
class Input:
    """One training input: ``kind`` is "text", "json", "parquet" or "saved" (save_to_disk)."""

    path: Path
    kind: str


def _saved_dataset(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file() or (path / "state.json").is_file()


def _input(path: Path) -> Input:
    if path.suffix == ".txt":
        return Input(path, "text")
    if path.suffix in (".jsonl", ".json"):
        return Input(path, "json")
    if path.suffix == ".parquet":
        return Input(path, "parquet")
    raise DataError(
        f"data file {path} has unknown suffix {path.suffix!r}; use {FORMATS}"
    )


def find_inputs(paths: str | Path | Sequence[str | Path]) -> list[Input]:
    """The inputs in ``paths``: files as given, a saved dataset directory as one input, other
    directories expanded to their sorted data files (not recursive)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    inputs: list[Input] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise DataError(
                f"data path {path} does not exist; check the path passed as training data"
            )
        _check_regular(path)
        if path.is_dir() and _saved_dataset(path):
            inputs.append(Input(path, "saved"))
        elif path.is_dir():
            found = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in SUFFIXES)
            if not found:
                raise DataError(
                    f"data directory {path} holds no {', '.join(SUFFIXES)} files and is not a "
                    "saved dataset; put the training data there or pass the files directly"
                )
            inputs.extend(_input(p) for p in found)
        else:
            inputs.append(_input(path))
    if not inputs:
        raise DataError(f"no data files were given; pass at least one of: {FORMATS}")
    return inputs


def _check_regular(path: Path) -> None:
    """Refuse a path that is neither a regular file nor a directory before anything opens it: a
    FIFO would block the first read with no message, and the data is read several times."""
    mode = path.stat().st_mode
    if stat.S_ISREG(mode) or stat.S_ISDIR(mode):
        return
    what = next((name for test, name in _SPECIAL if test(mode)), "a special file")
    raise DataError(
        f"data path {path} is {what}, not a regular file or a directory; the data is read more than "
        "once, so write it to a file and pass that"
    )


# --------------------------------------------------------------------------- plain text


def split_at_whitespace(text: str, limit: int) -> int:
    """Where to cut ``text`` (longer than ``limit``) into a first piece of at most ``limit``
    chars: just before the last whitespace character followed by a non-space in the second half
    of that range, so the space stays with the word after it, as byte-level BPE and
    SentencePiece pre-tokenisers attach it. Without such a place, a hard cut at ``limit``.
    """
    low = max(1, limit // 2)
    if _SPACE_BEFORE_WORD.search(text, low, limit + 2) is None:
        return limit
    for cut in range(limit, low - 1, -1):  # text has spaces every few chars: a short walk
        if text[cut].isspace() and not text[cut + 1 : cut + 2].isspace():
            return cut
    return limit


def pieces(text: str, limit: int) -> Iterator[tuple[str, bool]]:
    """One document ``text`` as ``(piece, ends_document)`` of at most ``limit`` chars, cut at
    whitespace."""
    start = 0
    while len(text) - start > limit:
        cut = start + split_at_whitespace(text[start : start + limit + 2], limit)
        yield text[start:cut], False
        start = cut
    yield text[start:], True


def text_pieces(path: Path, limit: int) -> Iterator[tuple[str, bool]]:
    """The documents of a ``.txt`` file as ``(piece, ends_document)``, read ``limit`` chars at a
    time; a document longer than ``limit`` comes in several pieces cut at whitespace.

    Blank lines separate documents; the separating newlines belong to neither side, and the
    trailing newlines of the file are dropped. A piece may be empty (a document's end).
    """
    buf = ""
    try:
        with open(path, encoding="utf-8") as f:
            while True:
                chunk = f.read(limit)
                eof = not chunk
                buf += chunk
                while True:
                    match = _DOC_SEPARATOR.search(buf)
                    # A separator touching the end of the buffer may continue in the next read.
                    if match is None or (match.end() == len(buf) and not eof):
                        break
                    yield buf[: match.start()], True
                    buf = buf[match.end() :]
                if eof:
                    buf = buf.rstrip("\n")
                    if buf:
                        yield buf, True
                    return
                # Keep a possible separator at the end (trailing whitespace) for the next read.
                while len(buf) > limit:
                    cut = split_at_whitespace(buf, limit)
                    yield buf[:cut], False
                    buf = buf[cut:]
    except UnicodeDecodeError as exc:
        raise DataError(
            f"data file {path} is not valid UTF-8 (near byte {exc.start} of a read); re-encode "
            "it as UTF-8"
        ) from exc


def where(inp: Input, row: int) -> str:
    """How an error names record ``row`` (0-based) of ``inp``."""
    if inp.kind == "json" and not is_json_array(inp.path):
        return f"{inp.path}:{json_line_of(inp.path, row)}"
    return f"{inp.path} record {row + 1}"


# --------------------------------------------------------------------------- record formats


class Format(enum.Enum):
    """The record formats of the README's "Training data" table; one file holds one of them."""

    TEXT = '{"text"}'
    IDS = '{"input_ids"}'
    IDS_LABELS = '{"input_ids", "labels"}'
    INSTRUCTION = '{"prompt", "completion"}'
    CHAT = '{"messages"}'


def record_format(record: dict, where: str) -> Format:
    """Which format a record is in; checks its fields' types."""
    get = record.get if isinstance(record, dict) else (lambda _k: None)
    if get("input_ids") is not None:
        return Format.IDS if get("labels") is None else Format.IDS_LABELS
    if get("messages") is not None:
        messages = get("messages")
        if not isinstance(messages, list) or not all(
            isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages
        ):
            raise DataError(
                f'{where}: "messages" must be a list of {{"role": ..., "content": ...}} objects'
            )
        return Format.CHAT
    if get("prompt") is not None or get("completion") is not None:
        if not isinstance(get("prompt"), str) or not isinstance(get("completion"), str):
            raise DataError(f'{where}: "prompt" and "completion" must both be strings')
        return Format.INSTRUCTION
    if get("text") is not None:
        if not isinstance(get("text"), str):
            raise DataError(f'{where}: "text" must be a string')
        return Format.TEXT
    raise DataError(
        f'{where} has none of the fields "text", "input_ids", "prompt"/"completion" or '
        '"messages"; each record must be {"text": "..."}, {"input_ids": [...]}, '
        '{"prompt": "...", "completion": "..."} or {"messages": [{"role": ..., "content": ...}]}'
    )


class OneFormat:
    """The format of one file's records: its first record's, which every later one must share.
    The reader fixes a file's columns from its first MiB of records, so a mix would fail or pass by
    where it falls; refused always, it is refused at its line."""

    def __init__(self) -> None:
        self._first: tuple[Format, Callable[[], str]] | None = None

    def check(self, found: Format, where: Callable[[], str]) -> None:
        """Refuse a record (at ``where()``) whose format differs from the first one's."""
        if self._first is None:
            self._first = (found, where)
        elif found is not self._first[0]:
            first, first_where = self._first
            raise DataError(
                f"{where()} is a {found.value} record, but {first_where()}, the file's first, is a "
                f"{first.value} record; keep one record format per file: move the {found.value} records "
                "to a file of their own"
            )

    def check_record(self, record: Any, where: str) -> None:
        """``record_format`` and ``check`` for the line-by-line scan that locates a reader error."""
        self.check(record_format(record, where), lambda: where)


# --------------------------------------------------------------------------- tables


@contextlib.contextmanager
def _quiet_datasets():
    """The library logs its own account of a failure and draws progress bars; lazytrain
    reports failures itself as one DataError."""
    import datasets

    level = datasets.logging.get_verbosity()
    bars = datasets.utils.logging.is_progress_bar_enabled()
    datasets.logging.set_verbosity(logging.CRITICAL)
    datasets.disable_progress_bars()
    try:
        yield datasets
    finally:
        datasets.logging.set_verbosity(level)
        if bars:
            datasets.enable_progress_bars()


def _open_table(inp: Input, cache_dir: Path, datasets):
    if inp.kind == "saved":
        loaded = datasets.load_from_disk(str(inp.path))
        if isinstance(loaded, datasets.DatasetDict):
            if "train" not in loaded:
                raise DataError(
                    f"saved dataset {inp.path} has splits {sorted(loaded)} but no 'train'; save "
                    "the split to train on, or name it 'train'"
                )
            loaded = loaded["train"]
        return loaded
    builder = "parquet" if inp.kind == "parquet" else "json"
    # Mixed types raise instead of becoming JSON strings (a number would turn into text);
    # smaller reads than the library's 10 MB keep its working set small.
    options = {"on_mixed_types": None, "chunksize": READ_BYTES} if builder == "json" else {}
    return datasets.load_dataset(
        builder, data_files=str(inp.path), split="train", streaming=True,
        cache_dir=str(cache_dir), **options,
    )


def record_batches(
    inp: Input, rows: int, cache_dir: Path, check: Callable[[Any, str], Any]
) -> Iterator[tuple[int, dict[str, list]]]:
    """``(first row, columns)`` for consecutive batches of up to ``rows`` records of ``inp``;
    only the columns in ``FIELDS`` are kept. ``check`` validates one JSON record (it locates a
    reader error at its line, see NOTE: [Pathological JSON])."""
    if inp.kind == "json" and is_json_array(inp.path) and inp.path.suffix == ".jsonl":
        raise DataError(
            f'{inp.path}:1 is a JSON array, not an object such as {{"text": "..."}}; each line '
            "of a .jsonl file must be one JSON object (a .json file may hold one array)"
        )
    if inp.kind == "json" and not is_json_array(inp.path):
        check_json_lines(inp.path)
    first = 0
    with _quiet_datasets() as datasets:
        try:
            table = _open_table(inp, cache_dir, datasets)
            names = table.column_names
            if names is not None:
                keep = [name for name in names if name in FIELDS]
                if not keep:
                    raise DataError(
                        f"{inp.path} has the columns {sorted(names)} but none of "
                        f"{', '.join(FIELDS)}; see the --data formats in the README"
                    )
                table = table.select_columns(keep)
            for batch in table.iter(batch_size=rows):
                columns = {k: v for k, v in batch.items() if k in FIELDS}
                count = len(next(iter(batch.values()))) if batch else 0
                yield first, columns
                first += count
        except DataError:
            raise
        except Exception as exc:  # the readers raise many types for one cause: unreadable data
            if is_disk_full(exc):  # their cache under the token file's directory: not the data's fault
                raise
            if inp.kind == "json":
                raise locate_json_error(inp.path, exc, check) from None
            message = " ".join(str(exc).split())[:300]
            raise DataError(
                f"{inp.path} could not be read ({type(exc).__name__}: {message}); write it with "
                "pandas/pyarrow to_parquet() or datasets' save_to_disk()"
            ) from None
