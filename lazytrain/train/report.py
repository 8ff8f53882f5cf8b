"""What `lazytrain train` says about each step: the record it logs (log.jsonl) and the line it prints.

NOTE: [Honest throughput]
A packed or padded batch has slots that hold no token of any example or document: the padding at
the end of its rows. Counting them would credit a run for work that teaches nothing (one padded
row per chat example is ~85% padding at 1024 tokens), so ``tokens_per_s`` and ``tflops`` count the
global batch's tokens that are no padding; ``pad_fraction`` is the share of slots that are, and
``learnt_tokens`` the labels the loss counts (not -100, after each row's first position, which
the shifted loss never predicts). ``tflops`` is the step's model FLOPs a second: 6 x parameters x
those tokens, plus attention's own work over the sequences the global batch holds, where the
model's config gives its attention layers (NOTE: [Model FLOPs] in flops.py);
``tflops_counts_attention`` says whether it does.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Sequence

import torch

from lazytrain.train.flops import AttentionLayer, step_flops
from lazytrain.train.row_store import Batch


def step_record(step: int, loss: float, lr: float, seconds: float, batch: Batch, n_params: int,
                layers: Sequence[AttentionLayer] | None) -> dict:
    """The log record of one training step (NOTE: [Honest throughput]); ``layers``: the model's
    attention layers (``flops.attention_layers``), None where it has no config to read them from."""
    return {
        "step": step, "loss": loss, "lr": lr, "step_s": seconds,
        "tokens_per_s": batch.tokens / seconds, "tflops": step_flops(n_params, batch, layers) / seconds / 1e12,
        "tflops_counts_attention": layers is not None,
        "pad_fraction": batch.pad_fraction, "learnt_tokens": batch.learnt,
        "gpu_gib": torch.cuda.max_memory_allocated() / 2**30 if torch.cuda.is_available() else 0.0,
        "host_gib": host_gib(),
    }


def postfix(record: dict) -> dict:
    """The progress bar's fields."""
    return dict(loss=f"{record['loss']:.4f}", tok_s=f"{record['tokens_per_s']:.0f}", tflops=f"{record['tflops']:.3f}",
                gpu=f"{record['gpu_gib']:.2f}G", host=f"{record['host_gib']:.2f}G")


def line(record: dict) -> str:
    """The printed line of a step."""
    return f"step {record['step']:>5}  loss {record['loss']:.4f}  {record['tokens_per_s']:.0f} tok/s  lr {record['lr']:.2e}"


def host_gib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (2**30 if sys.platform == "darwin" else 2**20)
