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

NOTE: [Allocator retries]
When the caching allocator cannot place a block under the cap (NOTE: [Memory cap] in
runtime/trainer.py), it waits for the device, gives its cached free blocks back and retries: the
plan holds, with no out-of-memory error, but the step stalls. On the H200 (2026-12-05, 7649af6) a
7B plan at 1 x 65,536 tokens and 40 GiB retried 5 and 7 times a step and took 16.65-17.30 s against
12.87 planned (its plan before it: 1-2 retries, within 1 %); its reserved peak reached the cap
while 3.5 GiB sat in freed blocks it could not reuse, beside the profile's 2 GiB allocator reserve.
So each step's record carries its retries (``alloc_retries``), and the first slow one after the
warm-up steps says what they cost and where the room comes from. Plans now leave room for their
largest allocation (NOTE: [Room for the largest block] in solver/reserve.py), where the retries of
that row came from.
"""

from __future__ import annotations

import resource
import sys
from collections.abc import Sequence

import torch

from lazytrain.train.flops import AttentionLayer, step_flops
from lazytrain.train.row_store import Batch
from lazytrain.units import format_size


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


def allocator_retries() -> int:
    """The caching allocator's retries so far in this process (NOTE: [Allocator retries]); 0 without CUDA."""
    return torch.cuda.memory_stats().get("num_alloc_retries", 0) if torch.cuda.is_available() else 0


def retries_notice(step: int, retries: int, budget: int, planned_peak: int, hardware: str) -> str:
    """What a step's allocator retries cost and how to give the allocator room (NOTE: [Allocator retries])."""
    room = budget - planned_peak
    return (f"step {step}: the GPU's caching allocator ran out of room inside the {format_size(budget)} budget "
            f"{retries} time{'s' if retries != 1 else ''} and gave back its cached blocks to retry, each time waiting "
            f"for the GPU, which stalls the step. The plan leaves it {format_size(room)} beside its peak for blocks "
            f"it frees but cannot reuse; to leave more, set allocator_reserve_bytes above {room} in a copy of "
            f"hardware profile '{hardware}' and compile with it (--hardware FILE). The retries of every step are in "
            f"the log (alloc_retries).")


def host_gib() -> float:
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return peak / (2**30 if sys.platform == "darwin" else 2**20)
