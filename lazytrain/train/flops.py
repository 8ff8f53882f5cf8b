"""The model FLOPs of a training step, the work ``tflops`` in `lazytrain train`'s records counts.

NOTE: [Model FLOPs]
A step's model FLOPs are 6 x parameters x the global batch's tokens that are no padding (a
multiply-add of each weight with each token: 2 FLOPs forward, 4 backward; NOTE: [Honest
throughput] in report.py) plus attention's own work, which no parameter accounts for. In an
attention layer of width d_attn = num_attention_heads x head_dim, a query that sees a key costs
QK^T and PV, 4 x d_attn FLOPs forward (2 a multiply-add), and training 3.5 times that, 14 x d_attn:
the backward is 2.5 forwards (its four products and the scores it recomputes from Q and K), the
convention of FlashAttention's benchmarks. It is counted exactly for the sequences the batch
holds: one of L tokens has P = L(L+1)/2 (query, key) pairs under causal attention, P = sum over i
in 0..L-1 of min(i + 1, W) under a sliding window of W (Hugging Face's: query - key < W), and the
step adds 14 x d_attn x P over every attention layer and every sequence of every row of the global
batch. So packed rows of short examples add little and one long document a lot (a 7B at
1 x 262,144 tokens: about 4 x 6N). Otherwise these are model FLOPs, the usual MFU convention:
recomputed activations (a plan's recompute), masked scores and padding add nothing.

The sequences (``Batch.documents``, ``rows.sequence_lengths``) are the runs its ``position_ids`` restart
at 0, where an example or document starts (NOTE: [Packing] in packing.py), less each row's padding,
the side table's count that ``tokens`` subtracts: padding is no sequence, and they sum to
``tokens``. A row with no start marked in it (``--cross-document-attention``, ``--packing off``, a
step without ``position_ids``: marks are written only where the step takes them, run_data.py) is
one sequence, its tokens before the padding, which no causal query before it sees. Like ``tokens``
they are counted by every rank from the rows of the whole global batch (its own and the others',
read from the row file), so the figure is the global batch's with no collective. The layers' shapes
come from the model's Hugging Face config (``attention_layers``); a model without one (a plain model
file) has none to read, so its ``tflops`` count 6N alone and its records say so
(``tflops_counts_attention``: false).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from lazytrain.train.row_store import Batch

TRAINING = 14  # FLOPs of a (query, key) pair per unit of width, forward (4) and backward (10)
_FULL, _SLIDING = "full_attention", "sliding_attention"


@dataclass(frozen=True)
class AttentionLayer:
    width: int  # num_attention_heads x head_dim
    window: int | None  # keys a query sees, itself included (Hugging Face's sliding_window); None: all before it


def attention_layers(model: torch.nn.Module) -> tuple[AttentionLayer, ...] | None:
    """Each attention layer's shape, from the model's Hugging Face config (its text config for a
    composite one); None without such a config, or with layers that are not causal softmax
    attention (full or sliding), whose work this count does not know."""
    config = getattr(model, "config", None)
    if hasattr(config, "get_text_config"):
        config = config.get_text_config(decoder=True)
    layers, heads = getattr(config, "num_hidden_layers", None), getattr(config, "num_attention_heads", None)
    if not (isinstance(layers, int) and isinstance(heads, int)) or getattr(config, "use_bidirectional_attention", 0):
        return None
    head_dim = getattr(config, "head_dim", None) or getattr(config, "hidden_size", 0) // heads
    if not head_dim:
        return None
    window = getattr(config, "sliding_window", None)
    types = getattr(config, "layer_types", None)
    if types is None:  # configs before layer_types: Mistral's window on every layer, Qwen2's from max_window_layers on
        first = getattr(config, "max_window_layers", 0) or 0
        on = window is not None and getattr(config, "use_sliding_window", True) is not False
        types = [_SLIDING if on and i >= first else _FULL for i in range(layers)]
    if len(types) != layers or not set(types) <= {_FULL, _SLIDING}:
        return None
    return tuple(AttentionLayer(heads * head_dim, window if t == _SLIDING else None) for t in types)


def pairs(documents: np.ndarray, window: int | None) -> int:
    """The (query, key) pairs causal attention computes over sequences of these lengths: each
    query sees itself and the keys before it in its sequence, at most ``window`` in all."""
    lengths = np.asarray(documents, dtype=np.int64)
    seen = lengths if window is None else np.minimum(lengths, window)  # the last query's keys
    return int((seen * (seen + 1) // 2 + (lengths - seen) * seen).sum())


def attention_flops(layers: Sequence[AttentionLayer], documents: np.ndarray) -> int:
    """Training FLOPs of these attention layers over sequences of these lengths (NOTE: [Model FLOPs])."""
    widths: dict[int | None, int] = {}
    for layer in layers:
        widths[layer.window] = widths.get(layer.window, 0) + layer.width
    return TRAINING * sum(width * pairs(documents, window) for window, width in widths.items())


def step_flops(n_params: int, batch: Batch, layers: Sequence[AttentionLayer] | None) -> int:
    """The model FLOPs of a step over ``batch``'s global batch (NOTE: [Model FLOPs]); attention's
    only where the layers are known."""
    return 6 * n_params * batch.tokens + (attention_flops(layers, batch.documents) if layers is not None else 0)
