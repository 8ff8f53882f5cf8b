"""The data of a training run laid out for its model, and the batch its step is compiled for.

``--packing`` and ``--cross-document-attention`` choose the layout (NOTE: [Packing] in
packing.py); the model decides whether it can have it. Sequences packed into one row are kept apart
by ``position_ids`` alone, so:

* a model file declares its batch: with ``position_ids`` in ``example_batch()`` its rows may pack;
  without, examples packed several to a row are refused (the fix: ``--packing off``, or add them),
  and documents are let attend across each other, as the file's batch has always made them, with
  a line saying so;
* a Hugging Face directory takes ``position_ids`` (where its forward does), and its step is compiled
  with them exactly when some row holds two sequences: unpacked rows keep the plain causal mask,
  which the compiler turns into fused causal attention (passes/causal.py);
* whichever it is, a model whose rows pack must keep them apart: checked on its captured step
  (NOTE: [Document boundaries reach attention] in boundaries.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch

from lazytrain.errors import DataError
from lazytrain.train.boundaries import POSITIONS, check_boundaries
from lazytrain.train.data import CORPUS_PATH, PackedBatches
from lazytrain.train.evaluation import EvalSet
from lazytrain.train.packing import Layout

INPUTS = ("input_ids", "labels")


@dataclass(frozen=True)
class RunData:
    train: PackedBatches
    eval: EvalSet | None
    layout: Layout
    inputs: tuple[str, ...]  # what the step is compiled to take: INPUTS, and position_ids where rows pack


def zeros(inputs, shape) -> dict[str, torch.Tensor]:
    """A batch of ``inputs`` (names) of ``shape``, int64 zeros: what the step is compiled for."""
    ids = torch.zeros(tuple(shape), dtype=torch.long)
    return {name: ids.clone() for name in inputs}


def run_data(args, source, model: torch.nn.Module, tokenizer, vocab: int | None, rank: int, world: int,
             device: Callable[[], str]) -> RunData:
    """The run's training (and --eval-data) batches, laid out as the flags ask where the model can
    keep packed sequences apart; raises ``DataError`` or ``TraceError`` where it cannot."""
    takes = source.file_positions if source.file_positions is not None else _forward_takes_positions(model)
    layout = Layout(pack_examples=args.packing == "on", mask_documents=takes and not args.cross_document_attention)
    rows, seq = source.batch_shape
    common = dict(vocab_size=vocab, rank=rank, world=world, layout=layout)
    train = PackedBatches(args.data or [CORPUS_PATH], tokenizer, rows, seq, seed=args.seed,
                          shuffle=not args.no_shuffle, **common)
    held_out = EvalSet(args.eval_data, tokenizer, rows, seq, steps=args.eval_steps, **common) \
        if args.eval_data else None
    both = [d for d in (train, held_out) if d is not None]
    examples = any(d.stats.examples for d in both)
    if not takes and layout.pack_examples and examples:
        raise DataError(f"{_without_positions(source, model)}, so examples packed several to a row (--packing on, "
                        f"the default) would see each other; pass --packing off{_add(source)}")
    if not takes and not args.cross_document_attention and any(d.stats.documents for d in both):
        print(f"note: {_without_positions(source, model)}, so the documents concatenated into a row attend to "
              f"each other (as with --cross-document-attention){_add(source, ' to keep each to itself')}", flush=True)
    separated = any(d.separated for d in both)
    positions = takes and (source.file_positions or separated)
    inputs = INPUTS + ((POSITIONS,) if positions else ())
    if separated and source.file_positions is None:
        document_attention(model)
    if separated and rank == 0:
        from lazytrain.ir.capture import capture

        graph = capture(model, zeros(inputs, (rows // world, seq)), str(source.path), device())
        check_boundaries(graph, seq, str(source.path), f"pass {_unpacking(layout, both)}")
    return RunData(train, held_out, layout, inputs)


_ATTENTION_DROPOUT = ("attention_dropout", "attn_pdrop", "attention_probs_dropout_prob")  # config names


def document_attention(model: torch.nn.Module) -> bool:
    """Have a Hugging Face model whose attention goes through transformers' attention interface
    call the document attention operator, which reads the documents from position_ids (NOTE:
    [Document attention] in kernels/documents.py), in place of sdpa under a dense [S, S] mask
    built from them. Whether it did; a model that cannot switch keeps its own attention, and so does
    one with attention dropout, which the operator has not."""
    from lazytrain.kernels import documents

    can = getattr(model, "_can_set_attn_implementation", None)
    config = getattr(model, "config", None)
    if can is None or not can() or any(getattr(config, name, 0) for name in _ATTENTION_DROPOUT):
        return False
    model.set_attn_implementation(documents.register())
    return model.config._attn_implementation == documents.IMPLEMENTATION


def _forward_takes_positions(model: torch.nn.Module) -> bool:
    try:
        return POSITIONS in inspect.signature(model.forward).parameters
    except (TypeError, ValueError):  # a forward without a signature to read
        return False


def _without_positions(source, model: torch.nn.Module) -> str:
    if source.file_positions is not None:
        return f"example_batch() in {source.path} has no position_ids"
    return f"{type(model).__name__}'s forward takes no position_ids"


def _add(source, why: str = "") -> str:
    if source.file_positions is None:
        return ""
    rows, seq = source.batch_shape
    return f", or add position_ids (int64 [{rows}, {seq}]) to example_batch(){why}"


def _unpacking(layout: Layout, data) -> str:
    """The flags that lay ``data`` out one sequence to a row."""
    flags = []
    if layout.pack_examples and any(d.stats.examples for d in data):
        flags.append("--packing off")
    if layout.mask_documents and any(d.stats.documents for d in data):
        flags.append("--cross-document-attention")
    return " ".join(flags)
