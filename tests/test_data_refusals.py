"""What `--data` refuses before or while reading, each as one line naming the file (and line) and
the fix: a path that is no regular file or directory (a FIFO would block the first read), a JSON
line too long to parse whole, a file whose records mix formats, and a full disk under the token
file."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from lazytrain.errors import DataError
from lazytrain.train import json_lines, records, rows
from lazytrain.train.data import PackedBatches
from test_data import tok, write_jsonl  # noqa: F401 -- the fixture and the writer the data tests share

ROOT = Path(__file__).resolve().parents[1]


# --------------------------------------------------------------------------- special files


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs on this platform")
def test_a_fifo_is_refused_before_it_is_opened(tmp_path):
    """A FIFO given as data is refused by its kind, without opening it (opening one with no writer
    blocks forever); run in a child process so a regression fails on the timeout, not by hanging."""
    fifo = tmp_path / "stream.jsonl"
    os.mkfifo(fifo)
    child = ("import sys\nfrom lazytrain.train.data import PackedBatches, builtin_tokenizer\n"
             "from lazytrain.errors import DataError\n"
             "try:\n    PackedBatches(sys.argv[1], builtin_tokenizer(), 1, 4)\n"
             "except DataError as exc:\n    print(exc)\n")
    out = subprocess.run([sys.executable, "-c", child, str(fifo)], cwd=ROOT, capture_output=True, text=True,
                         timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.stdout.strip() == (f"data path {fifo} is a FIFO (named pipe), not a regular file or a directory; "
                                  "the data is read more than once, so write it to a file and pass that"), out.stderr


def test_a_device_is_refused(tok):
    with pytest.raises(DataError, match=r"^data path /dev/null is a character device, not a regular file or a "
                                        r"directory; .* write it to a file and pass that$"):
        PackedBatches("/dev/null", tok, 1, 4)


# --------------------------------------------------------------------------- record size


def test_a_json_line_longer_than_the_record_limit_is_refused_before_it_is_parsed(tmp_path, tok, monkeypatch):
    """A line past MAX_RECORD_BYTES (made small here) is refused by the streaming scan, naming its
    line and size, before the reader sees the file; shorter lines around it are fine."""
    monkeypatch.setattr(json_lines, "MAX_RECORD_BYTES", 8 << 10)
    monkeypatch.setattr(json_lines, "READ_BYTES", 1 << 10)  # the line spans many reads
    monkeypatch.setattr(records, "_open_table", lambda *a: pytest.fail("the reader was reached"))
    path = tmp_path / "long.jsonl"
    short = json.dumps({"text": "x" * 7000}) + "\n"  # under the limit
    path.write_text(short + "\n" + json.dumps({"text": "a" * 20_000}) + "\n" + short)
    with pytest.raises(DataError) as info:
        PackedBatches(path, tok, 1, 4)
    assert str(info.value) == (
        f"{path}:3 is one record of 19.6 KiB, more than the 8.0 KiB a record may take (read whole, it would "
        "take several times that in memory); split it into records, one JSON object a line, or give a long "
        "text as a .txt file")
    path.write_text(short + json.dumps({"text": "a" * 20_000}))  # the last line, without a newline
    with pytest.raises(DataError, match=r"long\.jsonl:2 is one record of 19\.6 KiB, more than the 8\.0 KiB"):
        PackedBatches(path, tok, 1, 4)


# --------------------------------------------------------------------------- one format per file


@pytest.mark.parametrize("later, name", [
    ({"input_ids": [5, 6, 7]}, '{"input_ids"}'),
    ({"prompt": "Q", "completion": "A"}, '{"prompt", "completion"}'),
    ({"messages": [{"role": "user", "content": "Hi"}]}, '{"messages"}'),
])
def test_a_jsonl_mixing_record_formats_is_refused_at_the_first_that_differs(tmp_path, tok, later, name):
    path = tmp_path / "mixed.jsonl"
    path.write_text(json.dumps({"text": "hello world " * 30}) + "\n\n"
                    + json.dumps({"text": "more"}) + "\n" + json.dumps(later) + "\n")
    with pytest.raises(DataError) as info:
        PackedBatches(path, tok, 1, 4)
    assert str(info.value) == (
        f'{path}:4 is a {name} record, but {path}:1, the file\'s first, is a {{"text"}} record; keep one record '
        f"format per file: move the {name} records to a file of their own")


def test_ids_with_and_without_labels_are_two_formats(tmp_path, tok):
    path = write_jsonl(tmp_path / "ids.jsonl", [{"input_ids": [5, 6], "labels": [-100, 6]}, {"input_ids": [7, 8]}])
    with pytest.raises(DataError, match=r'ids\.jsonl:2 is a \{"input_ids"\} record, but .*ids\.jsonl:1, the '
                                        r"file's first, is a \{\"input_ids\", \"labels\"\} record"):
        PackedBatches(path, tok, 1, 2)


def test_a_json_array_and_a_parquet_file_mixing_formats_are_refused(tmp_path, tok):
    import pyarrow as pa
    import pyarrow.parquet as pq

    array = tmp_path / "mixed.json"
    array.write_text(json.dumps([{"text": "hello world " * 30}, {"input_ids": [5, 6, 7]}]))
    with pytest.raises(DataError, match=r'mixed\.json record 2 is a \{"input_ids"\} record, but .*mixed\.json '
                                        r"record 1, the file's first, is a \{\"text\"\} record"):
        PackedBatches(array, tok, 1, 4)
    table = tmp_path / "mixed.parquet"
    pq.write_table(pa.table({"text": ["hello world " * 30, None], "prompt": [None, "Q"],
                             "completion": [None, "A"]}), table)
    with pytest.raises(DataError, match=r'mixed\.parquet record 2 is a \{"prompt", "completion"\} record'):
        PackedBatches(table, tok, 1, 4)


def test_several_files_may_each_hold_their_own_format(tmp_path, tok):
    text = write_jsonl(tmp_path / "a.jsonl", [{"text": "hello world"}])
    ids = write_jsonl(tmp_path / "b.jsonl", [{"input_ids": [5, 6, 7]}])
    assert PackedBatches([text, ids], tok, 1, 4).stats.documents == 2


# --------------------------------------------------------------------------- a full TMPDIR


class _FillsUp:
    """A file whose disk fills after ``room`` bytes, as a write then raises ENOSPC."""

    def __init__(self, path, mode, room: int):
        self._file, self._room = open(path, mode), room

    def write(self, data: bytes) -> int:
        if len(data) > self._room:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        self._room -= len(data)
        return self._file.write(data)

    def close(self) -> None:
        self._file.close()


def test_a_full_tmpdir_names_the_token_file_and_what_it_had_written(tmp_path, monkeypatch, capsys):
    """`lazytrain train` whose token file fills its disk says where (under TMPDIR), how much it had
    written, and to set TMPDIR to a disk with room; the half-written directory is removed."""
    from lazytrain.cli import main

    tmp = tmp_path / "tmp"
    tmp.mkdir()
    monkeypatch.setenv("TMPDIR", str(tmp))
    monkeypatch.setattr(tempfile, "tempdir", None)  # read TMPDIR again
    monkeypatch.setattr(rows, "_FLUSH_TOKENS", 64)  # a write every row
    monkeypatch.setattr(rows, "open", lambda path, mode: _FillsUp(path, mode, room=3 * 4 * 64), raising=False)
    data = tmp_path / "d.txt"
    data.write_text("Rivers carry mud to the sea and bees make honey.\n\n" * 200)
    assert main(["train", "--steps", "1", "--data", str(data), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"lazytrain: error: no space left on the disk to write the token file {tmp}/lazytrain-data-")
    assert "/tokens.u32: it had written 768 B (192 tokens at 4 bytes each) when the disk filled, " in err
    assert err.endswith("free; set TMPDIR to a directory on a disk with room for 4 bytes a token of the training "
                        "data, or free space on that disk") and "\n" not in err
    assert not list(tmp.glob("lazytrain-data-*"))
