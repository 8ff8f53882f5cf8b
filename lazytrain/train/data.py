"""Training data: tokenizers, and packed batches that can be resumed exactly.

``PackedBatches`` turns ``.txt`` and ``.jsonl`` files into an endless stream of fixed-shape
batches ``{"input_ids", "labels"}`` of ``[batch_size, seq_len]`` int64 tensors, which is the
only shape a compiled training step accepts. Every document is tokenised, followed by the end of
text token, concatenated into one token stream and cut into rows of ``seq_len`` tokens (the
tail that does not fill a row is dropped). Epoch 0 reads the rows in stream order; every later
epoch reads them in a permutation drawn from ``(seed, epoch)``, so the whole sequence of
batches is a pure function of the data, ``seq_len`` and ``seed``. ``state_dict()`` is the
position in that sequence, so a resumed run yields exactly the batches an uninterrupted run
would have.

Every problem with the data is a ``DataError`` that names the file (and line) and the fix.
"""

from __future__ import annotations

import hashlib
import json
from array import array
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import torch

from lazytrain.errors import DataError

ASSETS = Path(__file__).resolve().parent / "assets"
CORPUS_PATH = ASSETS / "corpus.txt"
TOKENIZER_PATH = ASSETS / "tokenizer.json"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"

SUFFIXES = (".txt", ".jsonl")
_STATE_VERSION = 1
# Names a bare tokenizer.json commonly uses for its end-of-text token.
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|im_end|>")


# --------------------------------------------------------------------------- tokenizers


def builtin_tokenizer():
    """The shipped 512-id byte-level BPE as a ``PreTrainedTokenizerFast``.

    eos is ``<|endoftext|>`` (id 0) and pad is ``<|pad|>`` (id 1).
    """
    from transformers import PreTrainedTokenizerFast

    return PreTrainedTokenizerFast(
        tokenizer_file=str(TOKENIZER_PATH), eos_token=EOS_TOKEN, pad_token=PAD_TOKEN
    )


def load_tokenizer(path: str | Path):
    """Load a local Hugging Face tokenizer from a directory or a ``tokenizer.json`` file.

    Never touches the network. A bare ``tokenizer.json`` carries no special-token roles, so
    its eos is taken from the first well-known end-of-text token it contains.
    Raises ``DataError`` naming ``path`` if it is missing or cannot be read as a tokenizer.
    """
    path = Path(path)
    if not path.exists():
        raise DataError(
            f"tokenizer {path} does not exist; pass a directory holding a Hugging Face tokenizer "
            "(tokenizer.json, tokenizer_config.json) or a tokenizer.json file"
        )
    try:
        if path.is_dir():
            from transformers import AutoTokenizer

            return AutoTokenizer.from_pretrained(str(path), local_files_only=True)
        from transformers import PreTrainedTokenizerFast

        tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(path))
    except Exception as exc:  # the libraries raise many types for one cause: unreadable files
        raise DataError(
            f"could not load a tokenizer from {path}: {type(exc).__name__}: {exc}; pass a "
            "directory saved with tokenizer.save_pretrained() or a valid tokenizer.json"
        ) from exc
    if tokenizer.eos_token is None:
        vocab = tokenizer.get_vocab()
        for candidate in _EOS_CANDIDATES:
            if candidate in vocab:
                tokenizer.eos_token = candidate
                break
    return tokenizer


def _id_bound(tokenizer) -> int:
    """One more than the largest id the tokenizer can produce (added tokens included)."""
    vocab = tokenizer.get_vocab()
    return max(len(tokenizer), max(vocab.values(), default=-1) + 1)


def check_vocab(tokenizer, vocab_size: int) -> None:
    """Raise ``DataError`` if ``tokenizer`` can produce an id ``>= vocab_size``.

    Such an id would index past the model's embedding table mid-training.
    """
    bound = _id_bound(tokenizer)
    if bound > vocab_size:
        raise DataError(
            f"the tokenizer produces token ids up to {bound - 1} ({bound} ids) but the model's "
            f"vocab_size is {vocab_size}; use the model's own tokenizer or a model config with "
            f"vocab_size >= {bound}"
        )


def _eos_id(tokenizer) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise DataError(
            "the tokenizer has no end-of-text token, so documents cannot be separated; "
            "set tokenizer.eos_token (e.g. '<|endoftext|>') before building batches"
        )
    return int(eos)


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    """Token ids of each text, without special tokens.

    Goes through the Rust backend when there is one: it batches, and it skips transformers'
    warning about documents longer than the model's context, which packing makes irrelevant.
    """
    if not texts:
        return []
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        return [enc.ids for enc in backend.encode_batch(texts, add_special_tokens=False)]
    return [list(tokenizer.encode(text, add_special_tokens=False)) for text in texts]


# --------------------------------------------------------------------------- reading files


def _expand(paths: str | Path | Sequence[str | Path]) -> list[Path]:
    """The data files in ``paths``: files as given, directories expanded to their sorted
    ``.txt``/``.jsonl`` files (not recursive)."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    files: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if not path.exists():
            raise DataError(
                f"data path {path} does not exist; check the path passed as training data"
            )
        if path.is_dir():
            found = sorted(p for p in path.iterdir() if p.is_file() and p.suffix in SUFFIXES)
            if not found:
                raise DataError(
                    f"data directory {path} holds no .txt or .jsonl files; put the training "
                    "text there or pass the files directly"
                )
            files.extend(found)
        elif path.suffix in SUFFIXES:
            files.append(path)
        else:
            raise DataError(
                f"data file {path} has unknown suffix {path.suffix!r}; use .txt (the whole file "
                'is one document) or .jsonl (one {"text": ...} or {"input_ids": [...]} per line)'
            )
    if not files:
        raise DataError("no data files were given; pass at least one .txt or .jsonl file")
    return files


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise DataError(
            f"data file {path} is not valid UTF-8 (byte {exc.start}); re-encode it as UTF-8"
        ) from exc


def _read_jsonl(path: Path, seq_len: int, vocab_bound: int) -> list[tuple[str, Any]]:
    """The documents of a JSONL file, in order, as ``("text", str)`` or ``("ids", list[int])``.

    A record with ``input_ids`` is used as is (it wins over ``text``); it must fit in one row
    and every id must be in ``[0, vocab_bound)``.
    """
    docs: list[tuple[str, Any]] = []
    for lineno, line in enumerate(_read_text(path).splitlines(), start=1):
        if not line.strip():
            continue
        where = f"{path}:{lineno}"
        try:
            record = json.loads(line)
        except json.JSONDecodeError as exc:
            raise DataError(
                f"{where} is not valid JSON ({exc.msg}); each line of a .jsonl file must be "
                'one JSON object such as {"text": "..."}'
            ) from exc
        if isinstance(record, dict) and "input_ids" in record:
            ids = record["input_ids"]
            if not isinstance(ids, list) or not all(
                isinstance(i, int) and not isinstance(i, bool) for i in ids
            ):
                raise DataError(f'{where}: "input_ids" must be a list of integers')
            if len(ids) > seq_len:
                raise DataError(
                    f"{where}: sequence of {len(ids)} tokens is longer than the compiled shape's "
                    f"seq_len {seq_len}; split the record or compile with a larger seq_len"
                )
            bad = next((i for i in ids if not 0 <= i < vocab_bound), None)
            if bad is not None:
                raise DataError(
                    f"{where}: token id {bad} is outside the vocab (valid ids are "
                    f"0..{vocab_bound - 1}); tokenise the data with the model's tokenizer"
                )
            docs.append(("ids", ids))
        elif isinstance(record, dict) and "text" in record:
            if not isinstance(record["text"], str):
                raise DataError(f'{where}: "text" must be a string')
            docs.append(("text", record["text"]))
        else:
            raise DataError(
                f'{where} has neither a "text" nor an "input_ids" field; each line must be '
                '{"text": "..."} or {"input_ids": [...]}'
            )
    return docs


# --------------------------------------------------------------------------- batches


class PackedBatches:
    """An endless, resumable iterator of packed ``[batch_size, seq_len]`` batches.

    ``paths``: a ``.txt``/``.jsonl`` file, a directory of them, or a sequence of either.
    ``vocab_size``: the model's vocabulary; defaults to the tokenizer's. Token ids at or above
    it are rejected (a larger tokenizer is rejected through ``check_vocab``).

    Each document contributes its tokens followed by one eos (a pre-tokenised record that
    already ends with eos gets no second one; empty documents contribute nothing). A batch takes
    the next ``batch_size`` rows and continues into the next epoch when the current one runs
    out, so no row is skipped. Batches are fresh tensors; ``labels`` equals ``input_ids`` (the
    model shifts them).
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
    ):
        if batch_size < 1 or seq_len < 1:
            raise DataError(
                f"batch_size and seq_len must be positive, got batch_size={batch_size}, "
                f"seq_len={seq_len}"
            )
        self.batch_size = int(batch_size)
        self.seq_len = int(seq_len)
        self.seed = int(seed)
        if vocab_size is not None:
            check_vocab(tokenizer, vocab_size)
        vocab_bound = int(vocab_size) if vocab_size is not None else _id_bound(tokenizer)
        eos = _eos_id(tokenizer)
        files = _expand(paths)

        stream = self._tokenise(files, tokenizer, eos, vocab_bound)
        if stream.numel() == 0:
            names = ", ".join(str(f) for f in files)
            raise DataError(f"the training data has no tokens (all documents are empty): {names}")
        need = self.batch_size * self.seq_len
        if stream.numel() < need:
            raise DataError(
                f"the training data has {stream.numel()} tokens but one batch of "
                f"{self.batch_size} x {self.seq_len} needs {need}; add data or use a smaller "
                "batch_size or seq_len"
            )
        self.num_tokens = int(stream.numel())
        rows = self.num_tokens // self.seq_len
        self._rows = stream[: rows * self.seq_len].view(rows, self.seq_len)
        # Binds a saved position to this exact token stream (data, tokenizer and seq_len).
        self.data_digest = hashlib.sha256(self._rows.numpy().tobytes()).hexdigest()[:16]
        self._epoch = 0
        self._row = 0
        self._order_epoch = -1
        self._order: torch.Tensor | None = None

    def _tokenise(self, files: list[Path], tokenizer, eos: int, vocab_bound: int) -> torch.Tensor:
        """The whole token stream: every document's ids followed by eos, in file order."""
        stream = array("q")  # flat int64 buffer: far cheaper than one tensor per document
        for path in files:
            if path.suffix == ".txt":
                docs: list[tuple[str, Any]] = [("text", _read_text(path))]
            else:
                docs = _read_jsonl(path, self.seq_len, vocab_bound)
            texts = [doc for kind, doc in docs if kind == "text"]
            encoded = iter(_encode(tokenizer, texts))
            for kind, doc in docs:
                ids = next(encoded) if kind == "text" else doc
                if not ids:
                    continue  # an empty document would only add a stray eos
                stream.extend(ids)
                if ids[-1] != eos:
                    stream.append(eos)
        if not stream:
            return torch.empty(0, dtype=torch.long)
        return torch.frombuffer(stream, dtype=torch.long).clone()

    # ---------------------------------------------------------------- sizes

    @property
    def rows_per_epoch(self) -> int:
        """Rows of ``seq_len`` tokens in one pass over the data."""
        return int(self._rows.shape[0])

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def epoch(self) -> int:
        """The epoch the next batch starts in."""
        return self._epoch

    # ---------------------------------------------------------------- iteration

    def _epoch_order(self, epoch: int) -> torch.Tensor | None:
        """Row order of ``epoch``: None (stream order) for epoch 0, else a seeded permutation."""
        if epoch == 0:
            return None
        if self._order_epoch != epoch:
            generator = torch.Generator()
            # Distinct (seed, epoch) pairs give distinct 63-bit seeds for any realistic values.
            generator.manual_seed((self.seed * 1_000_003 + epoch) % (2**63))
            self._order = torch.randperm(self.rows_per_epoch, generator=generator)
            self._order_epoch = epoch
        return self._order

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        picked: list[torch.Tensor] = []
        need = self.batch_size
        while need:
            take = min(need, self.rows_per_epoch - self._row)
            order = self._epoch_order(self._epoch)
            if order is None:
                picked.append(self._rows[self._row : self._row + take])
            else:
                picked.append(self._rows[order[self._row : self._row + take]])
            self._row += take
            need -= take
            if self._row == self.rows_per_epoch:
                self._epoch += 1
                self._row = 0
        input_ids = torch.cat(picked).clone()
        return {"input_ids": input_ids, "labels": input_ids.clone()}

    # ---------------------------------------------------------------- resume

    def state_dict(self) -> dict[str, Any]:
        """The position of the next batch; JSON-serialisable (it goes into checkpoint meta)."""
        return {
            "version": _STATE_VERSION,
            "epoch": self._epoch,
            "row": self._row,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "rows_per_epoch": self.rows_per_epoch,
            "data_digest": self.data_digest,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position saved by ``state_dict()``.

        The saved seed is adopted, since it is part of the position. Raises ``DataError`` if
        the state was saved over different data, tokenizer or ``seq_len``: the same position
        would then name different tokens. ``batch_size`` may differ; the position is in rows.
        """
        try:
            version, epoch, row = state["version"], int(state["epoch"]), int(state["row"])
            saved = (state["seq_len"], state["rows_per_epoch"], state["data_digest"])
            seed = int(state["seed"])
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
        self.seed, self._epoch, self._row = seed, epoch, row
        self._order_epoch, self._order = -1, None


def builtin_batches(batch_size: int, seq_len: int, seed: int = 0) -> PackedBatches:
    """``PackedBatches`` over the shipped corpus with the shipped tokenizer."""
    return PackedBatches([CORPUS_PATH], builtin_tokenizer(), batch_size, seq_len, seed=seed)
