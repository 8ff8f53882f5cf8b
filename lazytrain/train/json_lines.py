"""Checks on JSON-lines files that run before (and after) the ``datasets`` reader.

NOTE: [Pathological JSON] pyarrow's JSON parser (under ``datasets``) recurses once per nesting
level and crashes the process (SIGSEGV) somewhere past 5,000 levels, so no exception can be
caught. Every JSON-lines file therefore gets a cheap streaming pass first (``check_json_lines``):
bytes-level bracket counts and a regex for surrogate escapes, and the exact check only on the few
lines those flag. Any other error the reader raises is located afterwards by a line-by-line scan
(``locate_json_error``), so every JSON problem is reported as ``file:line`` with the fix.

NOTE: [Record size] The reader holds a record whole, several times over: a one-line ``.jsonl`` of
60 MiB raised the peak RSS by 353 MiB (the same text as ``.txt``, read in pieces, by a few tens of
MiB), so a 1 GiB line takes gigabytes. The streaming pass therefore refuses a line longer than
``MAX_RECORD_BYTES`` before anything parses it; it holds at most that much of a line itself and
only measures the rest (a 66 MiB line: refused in 0.1 s, the peak up by 65 MiB,
``tests/test_data_memory.py``). 64 MiB is over a hundred times a long training document (a
128 Ki-token context is about 0.5 MiB of text), and the reader's share for it a few hundred MB.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any, BinaryIO, Callable

from lazytrain.errors import DataError
from lazytrain.units import format_size

MAX_DEPTH = 100  # nesting a training record never needs; far below pyarrow's crash
MAX_RECORD_BYTES = 64 << 20  # the longest JSON line read (NOTE: [Record size])
READ_BYTES = 1 << 20
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
_JSON_TOKEN = re.compile(rb'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def _json_lines(path: Path) -> Iterator[tuple[int, bytes]]:
    """``(line number, line)`` of a file read in bounded chunks; a line is held whole, so one
    longer than ``MAX_RECORD_BYTES`` is refused once that much of it is read (NOTE: [Record size])."""
    lineno = 0
    parts: list[bytes] = []
    held = 0  # bytes in parts: the line being read
    with open(path, "rb") as f:
        while chunk := f.read(READ_BYTES):
            parts.append(chunk)
            if b"\n" not in chunk:
                held += len(chunk)
                if held > MAX_RECORD_BYTES:
                    raise _too_long(path, lineno + 1, held + _rest_of_line(f))
                continue
            lines = b"".join(parts).split(b"\n")
            parts = [lines.pop()]
            held = len(parts[0])
            for line in lines:
                lineno += 1
                if len(line) > MAX_RECORD_BYTES:
                    raise _too_long(path, lineno, len(line))
                yield lineno, line
        tail = b"".join(parts)
        if tail:
            yield lineno + 1, tail


def _rest_of_line(f: BinaryIO) -> int:
    """Bytes from ``f``'s position to the end of its line, read without holding them."""
    rest = 0
    while chunk := f.read(READ_BYTES):
        end = chunk.find(b"\n")
        if end >= 0:
            return rest + end
        rest += len(chunk)
    return rest


def _too_long(path: Path, lineno: int, size: int) -> DataError:
    return DataError(
        f"{path}:{lineno} is one record of {format_size(size, round_up=True)}, more than the "
        f"{format_size(MAX_RECORD_BYTES)} a record may take (read whole, it would take several times "
        "that in memory); split it into records, one JSON object a line, or give a long text as a .txt file"
    )


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
    garble the reader (too deep, lone surrogates) or swamp its memory (too long, NOTE: [Record
    size]), naming the line. Cheap: C-level byte scans, exact parses only on flagged lines."""
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
        while offset > 0 and (chunk := f.read(min(offset, READ_BYTES))):
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
