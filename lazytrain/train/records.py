"""Reading training inputs: which files, the text pieces of a ``.txt``, the records of a table.

Plain text is read here in bounded pieces; every other format is read through the ``datasets``
library, streamed (JSON and Parquet) or memory-mapped (a ``save_to_disk`` directory), so no input
is ever held whole in memory. Records come out in batches of Python columns; what they mean is
``lazytrain.train.tokens``' business.

NOTE: [Pathological JSON] pyarrow's JSON parser (under ``datasets``) recurses once per nesting
level and crashes the process (SIGSEGV) somewhere past 5,000 levels, so no exception can be
caught. Every JSON-lines file therefore gets a cheap streaming pass first (``check_json_lines``):
bytes-level bracket counts and a regex for surrogate escapes, and the exact check only on the few
lines those flag. Any other error the reader raises is located afterwards by a line-by-line scan
(``locate_json_error``), so every JSON problem is reported as ``file:line`` with the fix.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from lazytrain.errors import DataError

TEXT_SUFFIXES = (".txt",)
TABLE_SUFFIXES = (".jsonl", ".json", ".parquet")
SUFFIXES = TEXT_SUFFIXES + TABLE_SUFFIXES
FIELDS = ("text", "input_ids", "labels", "prompt", "completion", "messages")
FORMATS = (
    ".txt (blank lines separate documents), .jsonl/.json/.parquet records, or a directory saved "
    "with datasets' save_to_disk()"
)
MAX_DEPTH = 100  # nesting a training record never needs; far below pyarrow's crash
_READ_BYTES = 1 << 20
# A blank line (only whitespace) between two lines separates documents; several count as one.
_DOC_SEPARATOR = re.compile(r"\n(?:[^\S\n]*\n)+")
_SPACE_BEFORE_WORD = re.compile(r"\s(?=\S)")
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


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


# --------------------------------------------------------------------------- JSON checks


def _json_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """``(line number, line)`` of a file read in bounded chunks; a line is held whole."""
    lineno = 0
    parts: list[bytes] = []
    with open(path, "rb") as f:
        while chunk := f.read(_READ_BYTES):
            if b"\n" not in chunk:
                parts.append(chunk)
                continue
            parts.append(chunk)
            data = b"".join(parts)
            lines = data.split(b"\n")
            parts = [lines.pop()]
            for line in lines:
                lineno += 1
                yield lineno, line
        tail = b"".join(parts)
        if tail:
            yield lineno + 1, tail


def _depth(line: bytes) -> int:
    depth = deepest = 0
    for match in _JSON_TOKEN.finditer(line):
        token = match.group()
        if token in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        elif token in (b"]", b"}"):
            depth -= 1
    return deepest


def _line_problem(line: bytes, exact: bool) -> str | None:
    """What is wrong with one JSON line, or None. ``exact`` parses it (slow); otherwise only
    the checks that guard the parser run, flagged by cheap byte counts."""
    if line.count(b"[") + line.count(b"{") > MAX_DEPTH:
        depth = _depth(line)
        if depth > MAX_DEPTH:
            return (
                f"is nested {depth} levels deep, more than the {MAX_DEPTH} a record may use; "
                "flatten the record"
            )
    if not exact and not _SURROGATE_ESCAPE.search(line):
        return None
    if not line.strip():
        return None
    try:
        record = json.loads(line.decode("utf-8"))
    except UnicodeDecodeError as exc:
        return f"is not valid UTF-8 (byte {exc.start} of the line); re-encode the file as UTF-8"
    except json.JSONDecodeError as exc:
        return (
            f"is not valid JSON ({exc.msg}); each line must be one JSON object such as "
            '{"text": "..."}'
        )
    except ValueError as exc:  # an integer past Python's digit limit: valid JSON, not ours to judge
        if "digits" in str(exc):
            return None
        raise
    try:
        json.dumps(record, ensure_ascii=False).encode("utf-8")
    except UnicodeEncodeError:
        return (
            "holds a lone UTF-16 surrogate escape (\\ud800-\\udfff without its pair), which "
            "is not text; fix or drop the string"
        )
    return None


def is_json_array(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4096).lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"[")


def check_json_lines(path: Path) -> None:
    """The streaming pass of NOTE: [Pathological JSON]: refuse lines that would crash or
    garble the reader (too deep, lone surrogates), naming the line. Cheap: C-level byte scans,
    exact parses only on flagged lines."""
    for lineno, line in _json_lines(path):
        problem = _line_problem(line, exact=False)
        if problem:
            raise DataError(f"{path}:{lineno} {problem}")


def locate_json_error(path: Path, exc: Exception, check: Callable[[Any, str], Any]) -> DataError:
    """A ``DataError`` for the first bad line of ``path``, found by parsing line by line after
    the reader failed with ``exc``; ``check(record, where)`` raises on a record lazytrain cannot
    use. Without such a line, the reader's own message with the file."""
    if not is_json_array(path):
        for lineno, line in _json_lines(path):
            problem = _line_problem(line, exact=True)
            if problem:
                return DataError(f"{path}:{lineno} {problem}")
            if line.strip():
                try:
                    check(json.loads(line), f"{path}:{lineno}")
                except DataError as found:
                    return found
                except ValueError:
                    pass
    message = " ".join(str(exc).split())[:300]
    if "column names don't match" in message:  # fields are fixed by the first MiB of records
        return DataError(
            f"{path}: its records change fields part way ({message}); keep one record format "
            "per file, e.g. text records and prompt/completion records in separate files"
        )
    found = re.search(r"at position (\d+)", message)  # the whole-file parser of a JSON array
    where = f"{path}:{_line_at(path, int(found.group(1)))}" if found else str(path)
    return DataError(
        f"{where} could not be read as JSON ({type(exc).__name__}: {message}); each line of a "
        ".jsonl file must be one JSON object, its fields keeping one type throughout, and a "
        ".json file one array of such objects"
    )


def _line_at(path: Path, offset: int) -> int:
    """The line of ``path`` holding byte ``offset``."""
    newlines = 0
    with open(path, "rb") as f:
        while offset > 0 and (chunk := f.read(min(offset, _READ_BYTES))):
            newlines += chunk.count(b"\n")
            offset -= len(chunk)
    return newlines + 1


def json_line_of(path: Path, row: int) -> int:
    """The line of ``path`` holding record ``row`` (0-based): JSON-lines readers skip blank
    lines. Scans the file, so it is only for error messages."""
    seen = -1
    for lineno, line in _json_lines(path):
        if line.strip():
            seen += 1
            if seen == row:
                return lineno
    return seen + 1


def where(inp: Input, row: int) -> str:
    """How an error names record ``row`` (0-based) of ``inp``."""
    if inp.kind == "json" and not is_json_array(inp.path):
        return f"{inp.path}:{json_line_of(inp.path, row)}"
    return f"{inp.path} record {row + 1}"


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
    options = {"on_mixed_types": None, "chunksize": _READ_BYTES} if builder == "json" else {}
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
            if inp.kind == "json":
                raise locate_json_error(inp.path, exc, check) from None
            message = " ".join(str(exc).split())[:300]
            raise DataError(
                f"{inp.path} could not be read ({type(exc).__name__}: {message}); write it with "
                "pandas/pyarrow to_parquet() or datasets' save_to_disk()"
            ) from None
