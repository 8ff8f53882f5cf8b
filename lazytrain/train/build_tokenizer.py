"""Rebuild the shipped tokenizer: ``python -m lazytrain.train.build_tokenizer [CORPUS] [OUT]``.

Trains a byte-level BPE with exactly ``VOCAB_SIZE`` ids on the shipped corpus and writes
``assets/tokenizer.json``. Ids 0 and 1 are the special tokens ``<|endoftext|>`` and ``<|pad|>``,
the next 256 are the byte alphabet (so any text encodes), and the rest are learned merges.
The training is deterministic, so rerunning the script reproduces the committed file.
"""

from __future__ import annotations

import argparse
from pathlib import Path

VOCAB_SIZE = 512
SPECIAL_TOKENS = ("<|endoftext|>", "<|pad|>")  # ids 0 and 1, in this order

ASSETS = Path(__file__).resolve().parent / "assets"
DEFAULT_CORPUS = ASSETS / "corpus.txt"
DEFAULT_OUT = ASSETS / "tokenizer.json"


def build(
    corpus: Path = DEFAULT_CORPUS, out: Path = DEFAULT_OUT, vocab_size: int = VOCAB_SIZE
) -> Path:
    """Train the tokenizer on ``corpus``, write it to ``out`` and return ``out``.

    Raises ``RuntimeError`` if the corpus is too small to learn enough merges to reach
    ``vocab_size`` ids: a smaller vocabulary would silently change every model built on it.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tokenizer = Tokenizer(models.BPE())
    # No prefix space: "Hello" and " Hello" stay distinct, as in GPT-2-style tokenizers.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        # The full byte alphabet guarantees that text outside the corpus still encodes.
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(corpus)], trainer)

    got = tokenizer.get_vocab_size()
    if got != vocab_size:
        raise RuntimeError(
            f"tokenizer trained on {corpus} has {got} ids, expected {vocab_size}; "
            "use a larger corpus so that enough merges can be learned"
        )
    for want_id, token in enumerate(SPECIAL_TOKENS):
        if tokenizer.token_to_id(token) != want_id:
            raise RuntimeError(f"special token {token} did not get id {want_id}")

    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out), pretty=False)
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("corpus", nargs="?", type=Path, default=DEFAULT_CORPUS)
    parser.add_argument("out", nargs="?", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args(argv)
    path = build(args.corpus, args.out)
    print(f"wrote {path} ({path.stat().st_size} bytes, {VOCAB_SIZE} ids)")


if __name__ == "__main__":
    main()
