"""How examples and documents share the fixed ``[batch, seq_len]`` rows of a compiled step.

NOTE: [Packing]
A compiled step has one shape, so every row holds ``seq_len`` tokens. Examples (prompt/completion,
chat, ids with labels) are short beside it (chat data for maths: ~160 tokens a conversation, a
tail to ~400), so one padded row per example spends most of the step on padding. With
``Layout.pack_examples`` the examples of a window (``WINDOW_ROWS`` rows' worth of tokens, in data
order) are put whole into rows by best-fit decreasing, as TRL's ``bfd`` strategy does: longest
first, each into the row with the least room that still holds it, a new row when none does. The
window keeps memory bounded and the result a pure function of the data, so the row file, the
per-epoch permutation and the saved position resume exactly as before. An example longer than
``seq_len`` is truncated to it first (it fills a row alone).

Documents (``.txt``, ``{"text"}``, ``{"input_ids"}`` without labels) are concatenated with an
end-of-text token between them and cut into rows, as always; with ``Layout.mask_documents`` each
one attends only to itself.

Several sequences in a row are kept apart by ``position_ids``: they restart at 0 where an example
or document starts, and the padding at a row's end is a run of its own. Hugging Face decoders turn
restarting positions into a block-diagonal causal mask when no ``attention_mask`` is given (and
rotary or learned position embeddings read the same positions), so each sequence sees itself
alone, exactly as in a row of its own; NOTE: [Document boundaries reach attention] in
boundaries.py says how a model is checked to do so. The loss shifts labels (the logit at ``t``
predicts the label at ``t + 1``), so the label at the first token of every packed example and
document is -100: no label crosses into the next sequence (at a row's start it is never a target
anyway). With both options off the rows are the ones earlier versions wrote, byte for byte, and
their saved positions still resume.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

WINDOW_ROWS = 256  # examples packed together: this many rows' worth of tokens (NOTE: [Packing])


@dataclass(frozen=True)
class Layout:
    """How rows are filled (NOTE: [Packing]): examples packed several to a row, and documents kept
    apart from each other by their positions. ``Layout(False, False)`` is one row per example and
    attention across documents."""

    pack_examples: bool = True
    mask_documents: bool = True

    def state(self) -> dict:
        """The layout as a data position records it."""
        return {"packing": self.pack_examples, "document_mask": self.mask_documents}

    @staticmethod
    def of_state(state: dict) -> Layout:
        """The layout of a saved position; positions saved before packing had no key: neither."""
        return Layout(bool(state.get("packing", False)), bool(state.get("document_mask", False)))

    def flags(self) -> str:
        """The ``lazytrain train`` flags that choose this layout."""
        parts = [f"--packing {'on' if self.pack_examples else 'off'}"]
        if not self.mask_documents:
            parts.append("--cross-document-attention")
        return " ".join(parts)


    def fix(self, other: Layout) -> str:
        """The flags that make a run laid out as ``other`` lay its data out as this layout."""
        parts = []
        if self.pack_examples != other.pack_examples:
            parts.append(f"--packing {'on' if self.pack_examples else 'off'}")
        if self.mask_documents != other.mask_documents:
            parts.append("no --cross-document-attention" if self.mask_documents else "--cross-document-attention")
        return " and ".join(parts)


UNPACKED = Layout(pack_examples=False, mask_documents=False)


def best_fit_decreasing(lengths: list[int], capacity: int) -> list[list[int]]:
    """Indices of ``lengths`` grouped into bins of at most ``capacity``, best fit decreasing:
    the longest first (ties in index order), each into the bin with the least room left that still
    holds it (ties: the earliest bin), a new bin when none does. Bins come in the order they were
    opened, their items in the order placed. Every length must be in ``[1, capacity]``.

        best_fit_decreasing([3, 5, 2, 4], 8) == [[1, 0], [3, 2]]
    """
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins: list[list[int]] = []
    room: list[tuple[int, int]] = []  # (room left, bin), sorted: the best fit is the first that holds
    for i in order:
        need = lengths[i]
        at = bisect.bisect_left(room, (need, -1))
        if at == len(room):
            bins.append([i])
            left, b = capacity - need, len(bins) - 1
        else:
            left, b = room.pop(at)
            bins[b].append(i)
            left -= need
        if left > 0:
            bisect.insort(room, (left, b))
    return bins


@dataclass
class PackingStats:
    """What the rows hold: counted as whole rows are written (the tail that fills no row is not)."""

    rows: int = 0
    slots: int = 0  # rows * seq_len
    padding: int = 0  # slots holding padding
    example_rows: int = 0  # rows that hold examples
    example_tokens: int = 0  # tokens of the examples, as written (truncated)
    examples: int = 0  # examples written into rows
    separated: bool = False  # some row holds two sequences that must not see each other

    @property
    def pad_fraction(self) -> float:
        return self.padding / self.slots if self.slots else 0.0

    def describe(self, seq_len: int, layout: Layout, documents: int) -> str:
        """The packing summary a run prints once."""
        parts = [f"{self.rows} rows of {seq_len} tokens, {100 * self.pad_fraction:.1f}% padding"]
        if self.examples and layout.pack_examples:
            unpacked = 1 - self.example_tokens / (self.examples * seq_len)
            parts.append(f"{self.examples} examples packed into {self.example_rows} rows (one row each: "
                         f"{self.examples} rows, {100 * unpacked:.1f}% of their slots padding)")
        elif self.examples:
            parts.append(f"{self.examples} examples one to a row (--packing off)")
        if documents:
            parts.append(f"{documents} documents, " + ("each attending to itself alone" if layout.mask_documents
                                                         else "attending across each other"))
        return "packing: " + "; ".join(parts)
