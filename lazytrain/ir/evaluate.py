"""Running the IR's nodes with the ATen operators they name: what pass `causal` evaluates a mask
with, and what `analysis/fused_saved.py` traces a stage's body with (on fake tensors)."""

from __future__ import annotations

import torch

from lazytrain.ir.graph import Node, OpKind, Sym


def operator(target: str):
    """The operator a CALL node names: "aten.mm.default" -> torch.ops.aten.mm.default."""
    ns, op, overload = target.split(".")
    return getattr(getattr(getattr(torch.ops, ns), op), overload)


def decode(arg, env: dict):
    """An IR argument as the operator takes it: node references from `env`, dtypes and layouts as
    torch's, devices as the CPU's (both callers run on it, or on fake tensors)."""
    if isinstance(arg, Sym):
        if arg.kind == "ref":
            return env[arg.value]
        if arg.kind == "device":
            return torch.device("cpu")
        return getattr(torch, arg.value)  # dtype, layout, memory_format
    if isinstance(arg, tuple):
        return [decode(a, env) for a in arg]
    return arg


def evaluate(n: Node, env: dict) -> None:
    """`n`'s value, from the values of what it reads in `env`, into `env`."""
    if n.op is OpKind.GETITEM:
        src, idx = n.args
        env[n.name] = env[src.value][idx]
        return
    env[n.name] = operator(n.target)(*decode(n.args, env), **{k: decode(v, env) for k, v in n.kwargs})
