"""lazytrain's IR: a training step's forward graph as frozen, slotted dataclasses.

NOTE: [IR immutability]
Nothing in the IR is edited in place. Passes return new objects (`dataclasses.replace`) or typed side
tables keyed by node name (costs, liveness, stages). That keeps every stage's output dumpable and
comparable, and lets a golden test pin any stage.

Argument encoding: a node's `args`/`kwargs` hold plain Python scalars, tuples, and `Sym` values for
everything else (references to other nodes, dtypes, devices, layouts, memory formats). `Sym` keeps
the IR printable as Python and serialisable as JSON without pickling torch objects.
"""

from __future__ import annotations

import enum
import hashlib
from dataclasses import dataclass, field
from typing import Iterator

# Element sizes by dtype name: the IR never needs torch to know a tensor's size.
DTYPE_BYTES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1, "complex64": 8,
}
FLOAT_DTYPES = frozenset({"float64", "float32", "float16", "bfloat16", "complex64"})


class OpKind(enum.Enum):
    # graph inputs: the user's batch, trainable parameters, buffers
    INPUT = "input"
    PARAM = "param"
    BUFFER = "buffer"
    # computation: one ATen operator call
    CALL = "call"
    # a `getitem` on an operator that returns several tensors
    GETITEM = "getitem"


@dataclass(frozen=True, slots=True)
class Sym:
    """A non-scalar argument: kind is "ref" (a node name), "dtype", "device", "layout" or "memory_format"."""

    kind: str
    value: str


@dataclass(frozen=True, slots=True)
class TensorSpec:
    shape: tuple[int, ...]
    dtype: str

    @property
    def numel(self) -> int:
        n = 1
        for d in self.shape:
            n *= d
        return n

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_BYTES.get(self.dtype, 4)

    @property
    def is_float(self) -> bool:
        return self.dtype in FLOAT_DTYPES

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(map(str, self.shape))}]"


# A node's value: one tensor, several (an operator returning a tuple), or nothing.
Value = TensorSpec | tuple[TensorSpec | None, ...] | None


def value_bytes(value: Value) -> int:
    if value is None:
        return 0
    if isinstance(value, TensorSpec):
        return value.nbytes
    return sum(v.nbytes for v in value if v is not None)


def largest_value_bytes(value: Value) -> int:
    """The bytes of the largest tensor in a value (`value_bytes` sums them)."""
    if value is None:
        return 0
    if isinstance(value, TensorSpec):
        return value.nbytes
    return max((v.nbytes for v in value if v is not None), default=0)


@dataclass(frozen=True, slots=True)
class Node:
    name: str
    op: OpKind
    target: str  # "aten.linear.default" for CALL; the parameter/buffer/input name for placeholders
    args: tuple = ()
    kwargs: tuple[tuple[str, object], ...] = ()
    value: Value = None
    module: str = ""  # innermost owning module path, e.g. "model.layers.3.mlp.up_proj"
    block: str | None = None  # the repeated block the node belongs to, e.g. "model.layers.3"

    def inputs(self) -> Iterator[str]:
        """Names of the nodes this node reads, in argument order."""
        yield from _refs(self.args)
        yield from _refs(tuple(v for _, v in self.kwargs))

    @property
    def spec(self) -> TensorSpec:
        if not isinstance(self.value, TensorSpec):
            raise TypeError(f"node {self.name} does not produce a single tensor")
        return self.value


def _refs(obj) -> Iterator[str]:
    if isinstance(obj, Sym):
        if obj.kind == "ref":
            yield obj.value
    elif isinstance(obj, tuple):
        for item in obj:
            yield from _refs(item)


@dataclass(frozen=True, slots=True)
class Graph:
    """A topologically ordered forward graph whose single output is the scalar loss."""

    nodes: tuple[Node, ...]
    output: str
    source: str = ""
    device: str = "cpu"  # the device type it was captured for (NOTE: [Capture on the target device] in ir/target.py)
    _index: dict = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        object.__setattr__(self, "_index", {n.name: n for n in self.nodes})

    def __getitem__(self, name: str) -> Node:
        return self._index[name]

    def __contains__(self, name: str) -> bool:
        return name in self._index

    def __iter__(self) -> Iterator[Node]:
        return iter(self.nodes)

    def __len__(self) -> int:
        return len(self.nodes)

    def of(self, *kinds: OpKind) -> tuple[Node, ...]:
        return tuple(n for n in self.nodes if n.op in kinds)

    def users(self) -> dict[str, list[str]]:
        """Node name -> names of nodes reading it (in graph order); the output counts as a user."""
        table: dict[str, list[str]] = {n.name: [] for n in self.nodes}
        for node in self.nodes:
            for name in dict.fromkeys(node.inputs()):
                table[name].append(node.name)
        table[self.output].append("<output>")
        return table

    def fingerprint(self) -> str:
        """Hash of the structure (ops, arguments, shapes, dtypes, parameter names): not costs or source."""
        from lazytrain.ir.dump import structural_text

        return hashlib.sha256(structural_text(self).encode()).hexdigest()[:16]
