"""What a stage's compute holds beyond the buffers the plan names for it (`act:S`, `saved:S`,
`grad:S`): its forward's, a saving forward's, its backward's, its recompute's and a chunked loss's
working sets, as the step model counts them per window and `lower` gives each compute event
(`Event.workspace`), so `verify` checks the same bytes (NOTE: [Backward memory] in
analysis/backward.py, NOTE: [Operator workspace] in analysis/memory.py)."""

from __future__ import annotations

from lazytrain.ir.stages import Stages


def backward_workspace(g) -> int:
    """What a stage's backward holds beyond what it saved (`analysis/backward.py`, NOTE: [Backward memory]):
    the gradients of its intermediates and its operators' workspace, and its weights' gradients made by
    its peak less all of them, which its event counts beside it (NOTE: [Weight gradients at the
    backward's peak]). A chunked stage's working set is one chunk's (its `peak_bytes`, counted apart),
    beside its operators' workspace."""
    if g.chunks > 1:
        return g.internal_bytes
    return max(0, g.backward_bytes - g.saved_bytes)


def chunk_workspace(stages: Stages, s: int) -> int:
    """A chunked stage's working set at its backward: one chunk's forward peak (`peak_bytes`), or
    the gradient of every weight it reads made anew by a later chunk and added into the first's,
    beside that chunk's logits' gradient in the compute dtype (at most a quarter of the peak, which
    holds the logits, their fp32 upcast and the log-probabilities). Measured on the H200: 1.17 GiB
    for Qwen2.5-7B's lm_head (1.02 GiB of bf16 weight) at 32 x 1024 tokens, where the peak is 0.90."""
    g = stages[s]
    return max(g.peak_bytes, stages.weight_bytes(s) + g.peak_bytes // 4)


def forward_workspace(g) -> int:
    """A forward without autograd's working set beside its outputs, which `act:S` holds: its
    liveness peak counts them from the node that makes them. Counted beside them, every forward
    window of a 7B plan at 1 x 65536 stood one layer output (448 MiB) over the measured one (H200,
    2026-12-01); the peak comes in the MLP, before the output exists."""
    if g.chunks > 1:
        return 0
    return max(0, g.peak_bytes - (g.out_bytes if g.consumers else 0))


def saving_workspace(g) -> int:
    """A saving forward's own working set beside what it saves and outputs: the values on their way
    to what autograd keeps, and its operators' workspace (NOTE: [Operator workspace] in analysis/memory.py)."""
    if g.chunks > 1:
        return 0
    return max(g.internal_bytes, g.saving_peak_bytes - g.saved_bytes - g.out_bytes)


def recompute_workspace(g) -> int:
    """A recomputing stage's backward: what it saves, made again, and its `backward_workspace`; or
    the recompute's own forward peak, if larger."""
    if g.chunks > 1:
        return 0
    return max(g.remat_backward_bytes or g.backward_bytes, g.saved_bytes, g.peak_bytes) - backward_workspace(g)
