"""Tokenizers for training data: the shipped one, a local Hugging Face one, and the checks a
tokenizer must pass against the model (its ids within the vocabulary, an end-of-text token)."""

from __future__ import annotations

from pathlib import Path

from lazytrain.errors import DataError, one_line

ASSETS = Path(__file__).resolve().parent / "assets"
CORPUS_PATH = ASSETS / "corpus.txt"
TOKENIZER_PATH = ASSETS / "tokenizer.json"
EOS_TOKEN = "<|endoftext|>"
PAD_TOKEN = "<|pad|>"
# Names a bare tokenizer.json commonly uses for its end-of-text token.
_EOS_CANDIDATES = (EOS_TOKEN, "</s>", "<eos>", "<|im_end|>")


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


def id_bound(tokenizer) -> int:
    """One more than the largest id the tokenizer can produce (added tokens included)."""
    vocab = tokenizer.get_vocab()
    return max(len(tokenizer), max(vocab.values(), default=-1) + 1)


def check_vocab(tokenizer, vocab_size: int) -> None:
    """Raise ``DataError`` if ``tokenizer`` can produce an id ``>= vocab_size``.

    Such an id would index past the model's embedding table mid-training.
    """
    bound = id_bound(tokenizer)
    if bound > vocab_size:
        raise DataError(
            f"the tokenizer produces token ids up to {bound - 1} ({bound} ids) but the model's "
            f"vocab_size is {vocab_size}; use the model's own tokenizer or a model config with "
            f"vocab_size >= {bound}"
        )


def eos_id(tokenizer) -> int:
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        raise DataError(
            "the tokenizer has no end-of-text token, so documents cannot be separated; "
            "set tokenizer.eos_token (e.g. '<|endoftext|>') before building batches"
        )
    return int(eos)
