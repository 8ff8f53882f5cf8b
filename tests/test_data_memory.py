"""Host memory of building batches stays bounded whatever the size of the corpus: a one-line
.txt and a .jsonl, generated in a temporary directory, each built in a fresh process that
reports its peak RSS growth (ru_maxrss) over a warm-up build of a tiny file of the same kind; and
a JSON line past the record limit is refused holding no more than the limit.

A word-level tokenizer keeps the test fast: what is measured is the data pipeline (reading,
piecing, the token file), not the tokenizer's speed. The figure for a 2 GB corpus with the
shipped BPE tokenizer is in the README."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("the quick brown fox jumps over a lazy dog while rivers carry mud to the sea and bees "
         "make honey in summer under a bright moon").split()
MiB = 1 << 20

CHILD = r"""
import json, resource, sys
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast
from lazytrain.train.data import PackedBatches

words, small, big = json.loads(sys.argv[1]), sys.argv[2], sys.argv[3]
vocab = {"<eos>": 0, "<unk>": 1, **{w: i + 2 for i, w in enumerate(sorted(set(words)))}}
backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
tok = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
warm = PackedBatches(small, tok, 2, 64)  # imports, allocator pools and thread pools
next(warm)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
batches = PackedBatches(big, tok, 8, 256)
for _ in range(50):
    next(batches)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"growth_kib": after - before, "tokens": batches.num_tokens}))
"""


def _write(path: Path, size: int, line) -> None:
    text = " ".join(WORDS[(i * 7) % len(WORDS)] for i in range(4096))
    with open(path, "w") as f:
        written = 0
        while written < size:
            chunk = line(text)
            f.write(chunk)
            written += len(chunk)


def _growth(tmp_path: Path, kind: str, size: int, line) -> tuple[int, int]:
    small, big = tmp_path / f"small.{kind}", tmp_path / f"big.{kind}"
    _write(small, 4096, line)
    _write(big, size, line)
    try:
        out = subprocess.run(
            [sys.executable, "-c", CHILD, json.dumps(WORDS), str(small), str(big)],
            cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
            capture_output=True, text=True, check=True,
        )
    finally:
        big.unlink()
    report = json.loads(out.stdout.strip().splitlines()[-1])
    return report["growth_kib"] * 1024, report["tokens"]


@pytest.mark.slow  # tokenising 64 MiB takes 10-30 s
@pytest.mark.parametrize("kind, size, line", [
    ("txt", 64 * MiB, lambda text: text + " "),  # one line, no newline at all
    ("jsonl", 64 * MiB, lambda text: json.dumps({"text": text}) + "\n"),
])
def test_building_batches_keeps_host_memory_bounded(tmp_path, kind, size, line):
    growth, tokens = _growth(tmp_path, kind, size, line)
    assert tokens > size // 8  # the whole file was tokenised
    # Holding the corpus once as text would already take `size`; as token lists, many times it
    # (7 GB for a 40 MB .txt before). Measured: about 30-40 MiB, most of it reached on the
    # first batches (tokenizer and reader buffers, allocator fragmentation).
    assert growth < size, f"peak RSS grew by {growth / MiB:.0f} MiB for a {size // MiB} MiB {kind}"


REFUSED = r"""
import json, resource, sys
from lazytrain.errors import DataError
from lazytrain.train.data import PackedBatches, builtin_tokenizer

tok = builtin_tokenizer()
next(PackedBatches(sys.argv[1], tok, 2, 64))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
try:
    PackedBatches(sys.argv[2], tok, 8, 256)
    message = None
except DataError as exc:
    message = str(exc)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
print(json.dumps({"growth_kib": after - before, "message": message}))
"""


@pytest.mark.slow  # writes and scans 66 MiB
def test_a_json_line_past_the_record_limit_is_refused_in_bounded_memory(tmp_path):
    """A one-line .jsonl a little over MAX_RECORD_BYTES is refused by the streaming scan, which
    holds at most the limit of it; read whole, such a line took several times its size."""
    from lazytrain.train.json_lines import MAX_RECORD_BYTES

    small, big = tmp_path / "small.jsonl", tmp_path / "big.jsonl"
    _write(small, 4096, lambda text: json.dumps({"text": text}) + "\n")
    words = " ".join(WORDS) + " "
    with open(big, "w") as f:
        f.write('{"text": "' + words * ((MAX_RECORD_BYTES + 2 * MiB) // len(words)) + '"}\n')
    out = subprocess.run(
        [sys.executable, "-c", REFUSED, str(small), str(big)],
        cwd=ROOT, env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin"},
        capture_output=True, text=True, check=True, timeout=300,
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["message"] == (
        f"{big}:1 is one record of 66.0 MiB, more than the 64.0 MiB a record may take (read whole, it would "
        "take several times that in memory); split it into records, one JSON object a line, or give a long "
        "text as a .txt file")
    growth = report["growth_kib"] * 1024
    assert growth < 1.5 * MAX_RECORD_BYTES, f"peak RSS grew by {growth / MiB:.0f} MiB"
