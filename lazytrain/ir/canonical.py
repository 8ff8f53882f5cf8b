"""Capture's node order and names, made independent of Python's hash seed.

NOTE: [Hash-seed independent capture]
Model code sometimes loops over a set of strings: Gemma 3 computes one rotary embedding per layer
type (`for layer_type in set(config.layer_types)`), other models one attention mask per layer type.
A set of strings iterates in an order that changes with PYTHONHASHSEED, so export records those
computations in another order, and names their nodes by that order, in every process: the
fingerprint would change from run to run, and a resumed run be refused as another model.

Such loops are recognisable in the trace. Their nodes ran from one source line of one frame (the
stack export records for each node), each iteration a stretch of the trace with no edge to the
others, reading the same data (position ids, hidden states) and differing only in the parameters,
buffers and constants it reads. `canonical_order` sorts such stretches (by the first weight each
reads, in the model's order, then by their structure) and hands their nodes' names out again in the
new order. Everything else keeps the order and the names export gave it: a graph without such a
loop comes out exactly as traced, and stretches of one line that read different data
(`return cos.to(dtype), sin.to(dtype)`) stay as written, as does a loop whose iterations do. The
order stays valid: stretches of one line with no edge between them cannot depend on each other
through a node outside them, which would have to lie between them.
"""

from __future__ import annotations

import hashlib
import itertools
import re

import torch

_FRAME = re.compile(r'File "([^"]*)", line (\d+), in (\S+)')
_COUNTER = re.compile(r"_\d+$")
_NO_WEIGHT = 1 << 62


def canonical_order(nodes: list[torch.fx.Node], labels: dict[str, str],
                    weights: dict[str, int]) -> tuple[list[torch.fx.Node], dict[str, str]]:
    """`nodes` (operator nodes, in trace order) in an order and with names that do not depend on the
    hash seed (NOTE: [Hash-seed independent capture]): returns the order and the renames (old name ->
    new name, only those that change). `labels` names each placeholder by what it holds (the same in
    every process); `weights` gives the parameter, buffer and constant placeholders their position
    in the model's order.

    Example: a trace `to(b_sliding) mul cos | to(b_full) mul_1 cos_1` (two iterations of one line,
    reading the same position ids) comes out `to(b_full) mul cos | to(b_sliding) mul_1 cos_1`
    when `b_full` comes first among the model's buffers, and unchanged when it already did.
    """
    frames = {n: tuple(_FRAME.findall(n.meta.get("stack_trace") or "")) for n in nodes}
    digest = _digests(nodes, labels)
    order = _order(nodes, 0, frames, digest, weights)
    if order == nodes:
        return nodes, {}
    names: dict[str, list[str]] = {}
    for n in nodes:  # each name family (`to`, `to_1`, ...) keeps its names, handed out in the new order
        names.setdefault(_COUNTER.sub("", n.name), []).append(n.name)
    handed = {family: iter(given) for family, given in names.items()}
    renames = {}
    for n in order:
        name = next(handed[_COUNTER.sub("", n.name)])
        if name != n.name:
            renames[n.name] = name
    return order, renames


def _digests(nodes: list[torch.fx.Node], labels: dict[str, str]) -> dict[torch.fx.Node, str]:
    """A hash of each node's computation (operator, constants, and its inputs' hashes down to the
    placeholders' labels): the same in every process, whatever the node is named."""
    out: dict[torch.fx.Node, str] = {}

    def text(arg) -> str:
        if isinstance(arg, torch.fx.Node):
            if arg not in out:
                out[arg] = "in " + labels.get(arg.name, arg.name)
            return out[arg]
        if isinstance(arg, (list, tuple)):
            return "(" + ",".join(text(a) for a in arg) + ")"
        if isinstance(arg, dict):
            return "{" + ",".join(f"{k}={text(v)}" for k, v in arg.items()) + "}"
        return repr(arg)

    for n in nodes:
        body = f"{n.target} {text(n.args)} {text(n.kwargs)}"
        out[n] = hashlib.sha256(body.encode()).hexdigest()[:16]
    return out


def _order(span, depth, frames, digest, weights) -> list[torch.fx.Node]:
    """`span` in canonical order: its runs of nodes from one source line at `depth`, each with its
    loop iterations sorted, and each iteration (or a run that is one) ordered the same way a frame
    deeper."""
    out = []
    for line, run in itertools.groupby(span, key=lambda n: frames[n][depth] if len(frames[n]) > depth else None):
        run = list(run)
        if line is None or len(run) == 1:
            out += run
            continue
        stretches = _stretches(run)
        if len(stretches) == 1:
            out += _order(run, depth + 1, frames, digest, weights)
            continue
        for stretch in _sorted_iterations(stretches, digest, weights):
            out += _order(stretch, depth + 1, frames, digest, weights)
    return out


def _stretches(run: list[torch.fx.Node]) -> list[list[torch.fx.Node]]:
    """`run` cut into as many contiguous stretches as no edge inside `run` crosses: parts of the
    graph independent of each other (an iteration may hold several unconnected pieces, interleaved)."""
    root = {n: n for n in run}

    def find(n):
        while root[n] is not n:
            root[n] = root[root[n]]
            n = root[n]
        return n

    for n in run:
        for m in n.all_input_nodes:
            if m in root:
                root[find(m)] = find(n)
    last = {find(n): i for i, n in enumerate(run)}  # where each piece ends
    out, start, end = [], 0, 0
    for i, n in enumerate(run):
        end = max(end, last[find(n)])
        if i == end:
            out.append(run[start:i + 1])
            start = i + 1
    return out


def _sorted_iterations(stretches, digest, weights) -> list[list[torch.fx.Node]]:
    """`stretches` (of one run, independent of each other) with each maximal sequence of neighbours
    that read the same data (inputs other than weights, from outside the stretch) sorted by the first
    weight each reads, then by structure."""
    def data(stretch):
        own = set(stretch)
        return frozenset(digest[m] for n in stretch for m in n.all_input_nodes
                         if m not in own and m.name not in weights)

    def key(stretch):
        first = min((weights[m.name] for n in stretch for m in n.all_input_nodes if m.name in weights),
                    default=_NO_WEIGHT)
        return first, sorted(digest[n] for n in stretch)

    out = []
    for _, same_data in itertools.groupby(stretches, key=data):
        out += sorted(same_data, key=key)
    return out
