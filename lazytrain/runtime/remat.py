"""Operators for a recompute before backward that skips values backward never reads.

A stage function with skipped nodes takes `remat`; with it, each such `linear` runs as
`grad_only_linear`: its forward returns zeros of the right shape and dtype, and its backward is
the linear's exact backward from the saved input and weight (NOTE: [Skipped recompute] in
analysis/remat.py proves nothing downstream of the zeros is read by a backward formula).
"""

from __future__ import annotations

import torch


class _GradOnlyLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        # zeros made from the shape alone: a traced graph then reads nothing of x in forward, and a
        # compiled recompute moves x's own computation into backward (NOTE: [Fused transients])
        return torch.zeros((*x.shape[:-1], weight.shape[0]), dtype=x.dtype, device=x.device)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g2 = grad.reshape(-1, grad.shape[-1])
        # the products eager autograd computes for `linear` (mm's backward of x @ w.t())
        gx = g2.mm(weight).view(x.shape) if ctx.needs_input_grad[0] else None
        gw = g2.t().mm(x.reshape(-1, x.shape[-1])) if ctx.needs_input_grad[1] else None
        gb = g2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return gx, gw, gb


def grad_only_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    return _GradOnlyLinear.apply(x, weight, bias)
