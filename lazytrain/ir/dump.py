"""Deterministic dumps of the IR: a text form for people and golden tests, JSON that loads back.

Text form, one line per node:
    name  op  target(args)  -> value  bytes  [block]  cost
No timestamps, no timings: two dumps of the same graph are byte-identical (STYLE.md point 9).
"""

from __future__ import annotations

import json
import math
from typing import Mapping

from lazytrain.ir.graph import Graph, Node, OpKind, Sym, TensorSpec, Value, value_bytes


def format_arg(arg) -> str:
    """Python source for one encoded argument (used by the dump and by codegen)."""
    if isinstance(arg, Sym):
        if arg.kind == "ref":
            return arg.value
        if arg.kind == "device":
            return "device"  # the runtime binds `device`; a compiled schedule is device-agnostic
        if arg.kind in ("dtype", "layout", "memory_format"):
            return f"torch.{arg.value}"
        raise ValueError(f"unknown Sym kind {arg.kind!r}")
    if isinstance(arg, tuple):
        return "[" + ", ".join(format_arg(a) for a in arg) + "]"
    if isinstance(arg, float) and not math.isfinite(arg):
        return f"float('{arg}')"
    return repr(arg)


def format_call(node: Node, target: str | None = None) -> str:
    """`target(args, kw=...)`; `target` defaults to the node's own."""
    parts = [format_arg(a) for a in node.args]
    parts += [f"{k}={format_arg(v)}" for k, v in node.kwargs]
    return f"{target or node.target}({', '.join(parts)})"


def format_value(value: Value) -> str:
    if value is None:
        return "None"
    if isinstance(value, TensorSpec):
        return str(value)
    return "(" + ", ".join("None" if v is None else str(v) for v in value) + ")"


def structural_text(graph: Graph) -> str:
    return "\n".join(_line(n, None) for n in graph.nodes) + f"\noutput {graph.output}\n"


def text(graph: Graph, costs: Mapping[str, object] | None = None) -> str:
    """The text dump; `costs` (node name -> object with `flops` and `time_s`) adds a cost column."""
    lines = [f"# graph {graph.fingerprint()}  nodes={len(graph)}  source={graph.source}"]
    lines += [_line(n, costs) for n in graph.nodes]
    lines.append(f"output {graph.output}")
    return "\n".join(lines) + "\n"


def _line(node: Node, costs) -> str:
    what = format_call(node) if node.op in (OpKind.CALL, OpKind.GETITEM) else node.target
    cols = [node.name, node.op.value, what, "->", format_value(node.value), f"{value_bytes(node.value)}B"]
    cols.append(f"[{node.block}]" if node.block else "[-]")
    if costs is not None and node.name in costs:
        c = costs[node.name]
        cols.append(f"flops={c.flops:.4g} t={c.time_s:.3g}s")
    return "  ".join(cols)


# ---- JSON ---------------------------------------------------------------------------------------

def _enc(obj):
    if isinstance(obj, Sym):
        return {"sym": obj.kind, "v": obj.value}
    if isinstance(obj, tuple):
        return [_enc(o) for o in obj]
    return obj


def _dec(obj):
    if isinstance(obj, dict):
        return Sym(obj["sym"], obj["v"])
    if isinstance(obj, list):
        return tuple(_dec(o) for o in obj)
    return obj


def _enc_value(value: Value):
    if value is None:
        return None
    if isinstance(value, TensorSpec):
        return {"shape": list(value.shape), "dtype": value.dtype}
    return [_enc_value(v) for v in value]


def _dec_value(obj) -> Value:
    if obj is None:
        return None
    if isinstance(obj, dict):
        return TensorSpec(tuple(obj["shape"]), obj["dtype"])
    return tuple(_dec_value(v) for v in obj)


def to_json(graph: Graph) -> str:
    nodes = [
        {
            "name": n.name, "op": n.op.value, "target": n.target, "args": _enc(n.args),
            "kwargs": [[k, _enc(v)] for k, v in n.kwargs], "value": _enc_value(n.value),
            "module": n.module, "block": n.block,
        }
        for n in graph.nodes
    ]
    return json.dumps({"source": graph.source, "device": graph.device, "output": graph.output, "nodes": nodes}, indent=1)


def from_json(textdata: str) -> Graph:
    data = json.loads(textdata)
    nodes = tuple(
        Node(
            name=d["name"], op=OpKind(d["op"]), target=d["target"], args=_dec(d["args"]),
            kwargs=tuple((k, _dec(v)) for k, v in d["kwargs"]), value=_dec_value(d["value"]),
            module=d["module"], block=d["block"],
        )
        for d in data["nodes"]
    )
    return Graph(nodes=nodes, output=data["output"], source=data["source"], device=data["device"])
