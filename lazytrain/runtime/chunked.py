"""A chunked loss stage's forward and backward, run together slice by slice of the batch.

NOTE: [Chunked loss]
A stage with `chunks` = k > 1 (the last: final norm, lm_head, cross-entropy; pass `chunk`) runs its
forward and backward together at its BWD event, over k slices of the batch, so only one slice's
logits exist at a time. Slices are either k groups of whole rows (`chunk_len` 0: every cut tensor
splits along dim 0 into k), or pieces of `chunk_len` consecutive positions of one row, row by row
(`tokens` = (B, T)): a tensor whose leading dimensions are (B, T) is cut at [b, j*len:(j+1)*len],
a flattened one (leading B*T, row-major) at the same tokens, [b*T + j*len, ...). The stage's
inputs, the batch inputs it reads and the results of its whole part (`whole_fn`: nodes reading
batch inputs alone, such as Hugging Face's label shift, run once before the slices) are cut so.
The mean over the whole batch is not the mean of the chunks' means when ignored targets (-100) are
spread unevenly, so each chunk returns its loss as a *sum* with the *count* of targets it covers,
and backward runs on the sum. Sums and their gradients add up over chunks exactly; scaling both by
1 / (total count) at the end gives the mean and its gradient, as one unchunked call would (up to
float rounding); on several ranks, by N / (the ranks' total count), NOTE: [Data parallel]. Gradients
a parameter already held (tied weights, accumulation over calls) are set aside meanwhile, so only
this stage's part is scaled.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


def slices(stage, t: torch.Tensor) -> list[torch.Tensor]:
    """Views of `t` for each slice of a chunked stage, in order (NOTE: [Chunked loss])."""
    if not stage.chunk_len:
        return list(t.chunk(stage.chunks))
    rows, seq = stage.tokens
    n = stage.chunk_len
    if t.dim() >= 2 and tuple(t.shape[:2]) == (rows, seq):
        return [t[b:b + 1, j:j + n] for b in range(rows) for j in range(0, seq, n)]
    flat = t.unflatten(0, (rows, seq))  # leading B*T, row-major: splitting a dimension is a view
    return [flat[b, j:j + n] for b in range(rows) for j in range(0, seq, n)]


def chunked_backward(stage, env: dict[str, torch.Tensor], weight: Callable[[str], torch.Tensor],
                     work: dict[str, torch.Tensor], placeholders: dict, device: torch.device,
                     dp) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward and backward of a chunked stage, slice by slice of the batch (NOTE: [Chunked loss]):
    its loss and its inputs' gradients; its parameters' (`work`) have been added to their `.grad`.
    `env`: the step's activations and batch inputs; `weight`: a placeholder's tensor; `placeholders`:
    the schedule's; `dp`: the data-parallel group, or None."""
    params = [p for p in stage.placeholders if p in work]  # shared (tied) ones too
    held = {p: work[p].grad for p in params}
    for p in params:
        work[p].grad = None
    cut = _cut(stage, env, weight, placeholders, device)
    grads = {x: torch.zeros_like(env[x]) for x in stage.grad_inputs}
    grad_slices = {x: slices(stage, g) for x, g in grads.items()}
    loss_sum = count = 0
    for c in range(stage.chunks):
        leaves = [cut[x][c].detach().requires_grad_(x in stage.grad_inputs) for x in stage.inputs]
        args = [cut[p][c] if p in cut else weight(p) for p in stage.placeholders] + leaves
        with torch.enable_grad():
            part, n = stage.fn(device, *args, *(cut[w][c] for w in stage.whole_outputs), loss_sum=True)
        if part.requires_grad:
            part.backward()
        for x, leaf in zip(stage.inputs, leaves):
            if x in grads and leaf.grad is not None:
                grad_slices[x][c].copy_(leaf.grad)
        loss_sum, count = loss_sum + part.detach().float(), count + n  # fp32: k partial sums
    scale = 1.0 / count if dp is None else dp.loss_scale(count)  # NOTE: [Data parallel] in data_parallel.py
    for g in grads.values():
        g.mul_(scale)
    for p in params:
        g = work[p].grad
        if g is not None:
            g.mul_(scale)
        if held[p] is not None:
            work[p].grad = held[p] if g is None else held[p].add_(g)
    return (loss_sum / count if dp is None else loss_sum * scale).to(part.dtype), grads


def chunked_forward(stage, env: dict[str, torch.Tensor], weight: Callable[[str], torch.Tensor],
                    placeholders: dict, device: torch.device) -> torch.Tensor:
    """A chunked stage's loss without autograd, slice by slice as `chunked_backward` makes it (the
    same sums in the same order, so the same loss): an evaluation's (NOTE: [Forward-only evaluation]
    in forward_only.py). One process's: several ranks' evaluations run the whole step."""
    cut = _cut(stage, env, weight, placeholders, device)
    loss_sum = count = 0
    with torch.no_grad():
        for c in range(stage.chunks):
            args = [cut[p][c] if p in cut else weight(p) for p in stage.placeholders]
            part, n = stage.fn(device, *args, *(cut[x][c] for x in stage.inputs),
                               *(cut[w][c] for w in stage.whole_outputs), loss_sum=True)
            loss_sum, count = loss_sum + part.float(), count + n
    return (loss_sum / count).to(part.dtype)


def _cut(stage, env: dict[str, torch.Tensor], weight: Callable[[str], torch.Tensor], placeholders: dict,
         device: torch.device) -> dict[str, list[torch.Tensor]]:
    """Each slice's view of the stage's inputs, the batch inputs it reads and its whole part's
    results (NOTE: [Chunked loss])."""
    whole = {}
    if stage.whole_fn is not None:
        with torch.no_grad():
            outs = stage.whole_fn(device, *[weight(p) for p in stage.placeholders])
        whole = dict(zip(stage.whole_outputs, outs))
    cut = {x: slices(stage, env[x]) for x in stage.inputs}  # activations and batch inputs: views
    cut.update({p: slices(stage, env[p]) for p in stage.placeholders if placeholders[p][0] == "input"})
    cut.update({n: slices(stage, t) for n, t in whole.items()})
    return cut
