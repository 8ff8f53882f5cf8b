"""Training data: tokenizers, and packed batches that can be resumed exactly.

``PackedBatches`` turns the ``--data`` inputs (``.txt``, ``.jsonl``/``.json``/``.parquet``
records, a saved ``datasets`` directory) into an endless stream of fixed-shape batches
``{"input_ids", "labels"}`` of ``[batch_size, seq_len]`` int64 tensors, which is the only shape a
compiled training step accepts. The inputs are tokenised once into rows of ``seq_len`` tokens in a
file on disk (``lazytrain.train.tokens``: documents packed with end-of-text tokens between them,
prompt/completion and chat examples one padded row each, labels -100 outside what is learnt).
Every epoch reads the rows in a permutation drawn from ``(seed, epoch)`` (``shuffle=False``: in
file order), so the whole sequence of batches is a pure function of the data, ``seq_len``, ``seed``
and the order. ``state_dict()`` is the position in that sequence, so a resumed run yields exactly
the batches an uninterrupted run would have.

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

import os
import shutil
import tempfile
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lazytrain.errors import DataError, one_line
from lazytrain.train import records, tokens

ASSETS = Path(__file__).resolve().parent / "assets"
CORPUS_PATH = ASSETS / "corpus.txt"
TOKENIZER_PATH = ASSETS / "tokenizer.json"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"

SUFFIXES = records.SUFFIXES
_STATE_VERSION = 1
_ORDERS = (0, 1, None)  # the first permuted epoch: every one, all but epoch 0 (NOTE: [Epoch order]), none
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
            f"could not load a tokenizer from {path}: {one_line(exc)}; pass a "
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
    take a padded row each (NOTE: [Packing and masking] in ``tokens``). A batch takes the next
    ``batch_size`` rows and continues into the next epoch when the current one runs out, so no
    row is skipped. Batches are fresh tensors; ``labels`` equals ``input_ids`` (the model shifts
    them) except for -100 where nothing is learnt.

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
        self._shuffle_from = 0 if shuffle else None  # the first epoch read permuted (NOTE: [Epoch order])
        if vocab_size is not None:
            check_vocab(tokenizer, vocab_size)
        vocab_bound = int(vocab_size) if vocab_size is not None else _id_bound(tokenizer)
        eos = _eos_id(tokenizer)
        pad = getattr(tokenizer, "pad_token_id", None)
        inputs = records.find_inputs(paths)

        self._dir = Path(tempfile.mkdtemp(prefix="lazytrain-data-", dir=workdir))
        self._fd: int | None = None
        self._cleanup = weakref.finalize(self, _release, self._dir, [None])
        try:
            built = tokens.build_rows(
                inputs, tokenizer, self.seq_len, vocab_bound, eos,
                eos if pad is None else int(pad), self._dir,
            )
        except BaseException:
            self._cleanup()
            raise
        self.stats = built.stats
        names = ", ".join(str(i.path) for i in inputs)
        if built.tokens == 0:
            self._cleanup()
            if built.stats.skipped:
                raise DataError(built.stats.nothing_learnt(self.seq_len, names))
            raise DataError(f"the training data has no tokens (all documents are empty): {names}; pass files "
                            "with text in them")
        need = self.batch_size * self.seq_len
        if built.tokens < need:
            self._cleanup()
            raise DataError(
                f"the training data has {built.tokens} tokens but one batch of "
                f"{self.batch_size} x {self.seq_len} needs {need}; add data or use a smaller "
                "batch_size or seq_len"
            )
        self.num_tokens = built.tokens
        self._rows_total = self.num_tokens // self.seq_len
        # Binds a saved position to this exact token stream (data, tokenizer and seq_len).
        self.data_digest = tokens.row_digest(built.path, self._rows_total, self.seq_len, built.masked)
        self._fd = os.open(built.path, os.O_RDONLY)
        self._cleanup.detach()
        self._cleanup = weakref.finalize(self, _release, self._dir, [self._fd])
        self._epoch = 0
        self._row = 0
        self._order_epoch = -1
        self._order: torch.Tensor | None = None

    def close(self) -> None:
        """Delete the token file now (it also goes when this object is collected)."""
        self._cleanup()

    # ---------------------------------------------------------------- sizes

    @property
    def rows_per_epoch(self) -> int:
        """Rows of ``seq_len`` tokens in one pass over the data."""
        return self._rows_total

    @property
    def tokens_per_batch(self) -> int:
        return self.batch_size * self.seq_len

    @property
    def epoch(self) -> int:
        """The epoch the next batch starts in."""
        return self._epoch

    # ---------------------------------------------------------------- iteration

    def _epoch_order(self, epoch: int) -> torch.Tensor | None:
        """Row order of ``epoch``: a seeded permutation, or None (file order) without shuffling."""
        if self._shuffle_from is None or epoch < self._shuffle_from:
            return None
        if self._order_epoch != epoch:
            generator = torch.Generator()
            # Distinct (seed, epoch) pairs give distinct 63-bit seeds for any realistic values.
            generator.manual_seed((self.seed * 1_000_003 + epoch) % (2**63))
            self._order = torch.randperm(self.rows_per_epoch, generator=generator)
            self._order_epoch = epoch
        return self._order

    def _read(self, first: int, count: int) -> tuple[np.ndarray, np.ndarray]:
        return tokens.read_rows(self._fd, self.seq_len, first, count)

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return self

    def __next__(self) -> dict[str, torch.Tensor]:
        picked: list[tuple[np.ndarray, np.ndarray]] = []
        share = self.batch_size // self.world
        first, last = self.rank * share, (self.rank + 1) * share  # this rank's rows of the global batch
        done = 0
        while done < self.batch_size:
            take = min(self.batch_size - done, self.rows_per_epoch - self._row)
            lo, hi = max(first, done) - done, min(last, done + take) - done  # its part of these rows
            if lo < hi:
                order = self._epoch_order(self._epoch)
                if order is None:
                    picked.append(self._read(self._row + lo, hi - lo))
                else:
                    picked.extend(self._read(int(r), 1) for r in order[self._row + lo : self._row + hi])
            self._row += take
            done += take
            if self._row == self.rows_per_epoch:
                self._epoch += 1
                self._row = 0
        input_ids = torch.from_numpy(np.concatenate([ids for ids, _ in picked]))
        labels = torch.from_numpy(np.concatenate([labels for _, labels in picked]))
        return {"input_ids": input_ids, "labels": labels}

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
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a position saved by ``state_dict()``.

        The saved seed and order are adopted, since they are part of the position. Raises ``DataError`` if
        the state was saved over different data, tokenizer or ``seq_len``: the same position
        would then name different tokens. ``batch_size`` may differ; the position is in rows.
        """
        try:
            version, epoch, row = state["version"], int(state["epoch"]), int(state["row"])
            saved = (state["seq_len"], state["rows_per_epoch"], state["data_digest"])
            seed = int(state["seed"])
            order = state.get("shuffle_from", 1)  # NOTE: [Epoch order]
            if order not in _ORDERS:
                raise ValueError(f"shuffle_from {order!r}")
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
        self.seed, self._epoch, self._row, self._shuffle_from = seed, epoch, row, order
        self._order_epoch, self._order = -1, None


def _release(directory: Path, fds: list[int | None]) -> None:
    for fd in fds:
        if fd is not None:
            os.close(fd)
    shutil.rmtree(directory, ignore_errors=True)


def builtin_batches(batch_size: int, seq_len: int, seed: int = 0, shuffle: bool = True) -> PackedBatches:
    """``PackedBatches`` over the shipped corpus with the shipped tokenizer."""
    return PackedBatches([CORPUS_PATH], builtin_tokenizer(), batch_size, seq_len, seed=seed, shuffle=shuffle)
