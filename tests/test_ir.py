"""IR unit tests (no solver, no replay): capture, dumps, lint, and the analysis passes.

Golden file: tests/golden/tiny_mlp.ir.txt holds the text dump of `TinyMLP`. After an intended
change to capture or the dump format, regenerate it with

    LAZYTRAIN_UPDATE_GOLDEN=1 python -m pytest tests/test_ir.py -k golden

and review the diff.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from lazytrain import hardware
from lazytrain.errors import PlanError
from lazytrain.ir import dump
from lazytrain.ir.capture import capture
from lazytrain.ir.graph import Graph, Node, OpKind, Sym, TensorSpec
from lazytrain.ir.lint import lint
from lazytrain.passes.blocks import blocks
from lazytrain.passes.costs import costs
from lazytrain.passes.liveness import liveness, storage_roots
from lazytrain.pipeline import compile_model
from models import BlockSpec, ModelSpec, hf_pair, random_block_model, tiny_gpt_pair

HW = hardware.load("cpu")
GOLDEN = Path(__file__).parent / "golden"


class TinyBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return F.relu(self.fc(x))


class TinyMLP(nn.Module):
    """Two identical blocks (`blocks.0`, `blocks.1`) and a mean-squared-error loss."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([TinyBlock(), TinyBlock()])

    def forward(self, x, y):
        for block in self.blocks:
            x = block(x)
        return ((x - y) ** 2).mean()


def tiny_mlp_graph() -> Graph:
    with torch.device("meta"):
        model = TinyMLP()
    return capture(model, {"x": torch.zeros(2, 4), "y": torch.zeros(2, 4)}, "tests/test_ir.py")


def analysed(graph: Graph):
    node_costs = costs(graph, HW)
    last_use = liveness(graph, node_costs)
    return node_costs, last_use, blocks(graph, node_costs, last_use)


# ---- hand-built graphs ----------------------------------------------------------------------------

def ref(name: str) -> Sym:
    return Sym("ref", name)


def f32(*shape: int) -> TensorSpec:
    return TensorSpec(tuple(shape), "float32")


def call(name, target, *args, value=None, **kwargs) -> Node:
    return Node(name, OpKind.CALL, target, tuple(args), tuple(kwargs.items()), value)


def linear_graph(x_shape, w_shape) -> Graph:
    out = f32(*x_shape[:-1], w_shape[0])
    return Graph((
        Node("x", OpKind.INPUT, "x", value=f32(*x_shape)),
        Node("w", OpKind.PARAM, "w", value=f32(*w_shape)),
        call("y", "aten.linear.default", ref("x"), ref("w"), value=out),
        call("loss", "aten.sum.default", ref("y"), value=f32()),
    ), output="loss")


# ---- dumps ----------------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def graphs():
    """Captured graphs of the tiny GPT (tied), a tiny Qwen2 and a random block model."""
    spec = ModelSpec((BlockSpec("mlp", 24, "gelu"), BlockSpec("norm", 16, "silu")), tied=True, table="grad")
    out = {}
    for name, (meta, _, batch) in {"tiny_gpt": tiny_gpt_pair(), "qwen2": hf_pair("qwen2"),
                                   "blocks": random_block_model(spec)}.items():
        out[name] = (capture(meta, batch, name), meta, batch)
    return out


@pytest.mark.parametrize("name", ["tiny_gpt", "qwen2", "blocks"])
def test_json_round_trip(graphs, name):
    graph, _, _ = graphs[name]
    text = dump.to_json(graph)
    back = dump.from_json(text)
    assert back == graph
    assert back.fingerprint() == graph.fingerprint()
    assert dump.text(back) == dump.text(graph)
    assert dump.to_json(back) == text


@pytest.mark.parametrize("name", ["tiny_gpt", "qwen2", "blocks"])
def test_text_dump_is_deterministic(graphs, name):
    """Two captures of the same model give byte-identical dumps (no timestamps, no ids)."""
    graph, meta, batch = graphs[name]
    again = capture(meta, batch, name)
    assert dump.text(again) == dump.text(graph)
    node_costs = costs(graph, HW)
    assert dump.text(again, costs(again, HW)) == dump.text(graph, node_costs)
    assert again.fingerprint() == graph.fingerprint()


def test_json_round_trip_hand_built_values():
    """Every kind of encoded argument survives JSON: refs, dtypes, devices, nested lists, None,
    bools, non-finite floats, tuple values with holes."""
    graph = Graph((
        Node("x", OpKind.INPUT, "x", value=TensorSpec((2, 3), "bfloat16")),
        call("t", "aten.split.Tensor", ref("x"), 1, -1, value=(f32(2, 1), None, f32(2, 1))),
        Node("g", OpKind.GETITEM, "getitem", (ref("t"), 0), value=f32(2, 1)),
        call("z", "aten.zeros.default", (2, (3, 4)), dtype=Sym("dtype", "float16"), device=Sym("device", "cpu"),
             pin_memory=False, value=TensorSpec((2, 3, 4), "float16")),
        call("m", "aten.clamp.default", ref("g"), float("-inf"), 1e-6, value=f32(2, 1)),
        call("loss", "aten.sum.default", ref("m"), value=f32()),
    ), output="loss", source="hand")
    back = dump.from_json(dump.to_json(graph))
    assert back == graph
    assert dump.text(back) == dump.text(graph)
    assert "float('-inf')" in dump.text(graph)


def test_golden_tiny_mlp():
    text = dump.text(tiny_mlp_graph())
    path = GOLDEN / "tiny_mlp.ir.txt"
    if os.environ.get("LAZYTRAIN_UPDATE_GOLDEN") == "1":
        path.parent.mkdir(exist_ok=True)
        path.write_text(text)
    assert path.is_file(), "no golden file: run with LAZYTRAIN_UPDATE_GOLDEN=1"
    assert text == path.read_text(), "the dump changed; if intended, regenerate with LAZYTRAIN_UPDATE_GOLDEN=1"


def test_compile_is_deterministic(tmp_path):
    """Two compiles give the same schedule text and byte-identical per-stage dumps (STYLE.md 9)."""
    with torch.device("meta"):
        model = TinyMLP()
    batch = {"x": torch.zeros(2, 4), "y": torch.zeros(2, 4)}
    a = compile_model(model, batch, 1 << 20, "cpu", source="tiny_mlp.py", dump_dir=tmp_path / "a")
    b = compile_model(model, batch, 1 << 20, "cpu", source="tiny_mlp.py", dump_dir=tmp_path / "b")
    assert a.source_text == b.source_text
    names = sorted(p.name for p in (tmp_path / "a").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "b").iterdir())
    assert "00-capture.txt" in names and "00-capture.json" in names
    for name in names:
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes(), name
    assert (tmp_path / "a" / "00-capture.txt").read_text() == dump.text(a.graph)
    assert dump.from_json((tmp_path / "a" / "00-capture.json").read_text()) == a.graph


def test_fingerprint_ignores_source_but_not_shapes():
    graph = tiny_mlp_graph()
    other_source = Graph(graph.nodes, graph.output, source="elsewhere.py")
    assert other_source.fingerprint() == graph.fingerprint()
    with torch.device("meta"):
        model = TinyMLP()
    wider = capture(model, {"x": torch.zeros(3, 4), "y": torch.zeros(3, 4)})
    assert wider.fingerprint() != graph.fingerprint()


def test_capture_names_placeholders_by_module_path():
    graph = tiny_mlp_graph()
    params = {n.name: n.target for n in graph.of(OpKind.PARAM)}
    assert params == {
        "p_blocks_0_fc_weight": "blocks.0.fc.weight", "p_blocks_0_fc_bias": "blocks.0.fc.bias",
        "p_blocks_1_fc_weight": "blocks.1.fc.weight", "p_blocks_1_fc_bias": "blocks.1.fc.bias",
    }
    assert [n.name for n in graph.of(OpKind.INPUT)] == ["x", "y"]
    assert {n.block for n in graph.of(OpKind.CALL)} == {"blocks.0", "blocks.1", None}
    assert graph[graph.output].value == f32()
    lint(graph)


# ---- blocks ---------------------------------------------------------------------------------------

def test_blocks_identical_kinds_tiny_mlp():
    _, _, stages = analysed(tiny_mlp_graph())
    assert [(s.name, s.kind) for s in stages] == [("blocks.0", "A"), ("blocks.1", "A"), ("epilogue", "B")]
    assert [s.consumers for s in stages] == [(1,), (2,), ()]
    assert stages[0].params == ("p_blocks_0_fc_weight", "p_blocks_0_fc_bias")
    assert stages[0].param_bytes == (16 + 4) * 4 and stages[0].param_numel == 20
    assert stages.shared_params == ()


def test_blocks_tied_gpt(graphs):
    """The GPT's three blocks share a kind; the tied embedding/head weight is shared, owned by no
    stage, and read by both the prologue and the epilogue."""
    graph, _, _ = graphs["tiny_gpt"]
    _, _, stages = analysed(graph)
    assert [s.name for s in stages] == ["prologue", "blocks.0", "blocks.1", "blocks.2", "epilogue"]
    kinds = [s.kind for s in stages]
    assert kinds[1] == kinds[2] == kinds[3]
    assert len({kinds[0], kinds[1], kinds[4]}) == 3
    assert len(stages.shared_params) == 1
    (shared,) = stages.shared_params
    assert graph[shared].target in ("wte.weight", "head.weight")
    assert all(shared not in s.params for s in stages)
    assert shared in stages[0].placeholders and shared in stages[4].placeholders
    assert stages.shared_numel == 96 * 32 and stages.shared_bytes == 96 * 32 * 4
    # no parameter has two owners
    owned = [p for s in stages for p in s.params] + list(stages.shared_params)
    assert len(owned) == len(set(owned))


def test_tied_weight_is_one_placeholder(graphs):
    graph, _, _ = graphs["tiny_gpt"]
    users = graph.users()
    unused = [n.name for n in graph.of(OpKind.PARAM) if not users[n.name]]
    assert unused == []


def test_blocks_kinds_follow_structure():
    """Blocks of equal kind and widths share a letter; a different width or kind gets a new one."""
    spec = ModelSpec((BlockSpec("linear", 16), BlockSpec("linear", 16), BlockSpec("linear", 8),
                      BlockSpec("norm", 8), BlockSpec("norm", 8)), width=16)
    meta, _, batch = random_block_model(spec)
    _, _, stages = analysed(capture(meta, batch))
    kinds = {s.name: s.kind for s in stages}
    assert kinds["blocks.0"] == kinds["blocks.1"]
    assert kinds["blocks.3"] == kinds["blocks.4"]
    assert len({kinds["blocks.1"], kinds["blocks.2"], kinds["blocks.3"]}) == 3


def test_blocks_table_read_by_every_block(graphs):
    """A tensor made before the blocks and read by all of them is a prologue output with one
    consumer per block; with gradient, every block passes gradient back to it."""
    graph, _, _ = graphs["blocks"]
    _, _, stages = analysed(graph)
    assert stages[0].name == "prologue"
    assert [s.name for s in stages] == ["prologue", "blocks.0", "blocks.1", "epilogue"]
    assert stages[0].consumers == (1, 2)
    assert not stages[0].chain and stages[1].chain
    table = [o for o in stages[0].outputs if all(o in s.inputs for s in stages[1:3])]
    assert table and all(table[0] in s.grad_inputs for s in stages[1:3])


# ---- costs ----------------------------------------------------------------------------------------

@pytest.mark.parametrize("x_shape, w_shape", [((3, 5), (7, 5)), ((2, 3, 5), (7, 5)), ((1, 1), (1, 1))])
def test_linear_flops(x_shape, w_shape):
    """aten.linear: 2*M*N*K FLOPs (M rows of x, N outputs, K inputs); backward costs twice forward."""
    graph = linear_graph(x_shape, w_shape)
    c = costs(graph, HW)["y"]
    m = 1
    for d in x_shape[:-1]:
        m *= d
    n, k = w_shape
    assert c.flops == 2 * m * n * k
    assert c.bwd_time_s == pytest.approx(2 * c.time_s)
    assert not c.alias
    assert c.bytes == 4 * (m * k + n * k + m * n)


def test_matmul_and_view_costs():
    graph = Graph((
        Node("a", OpKind.INPUT, "a", value=f32(3, 5)),
        Node("b", OpKind.PARAM, "b", value=f32(5, 7)),
        call("c", "aten.mm.default", ref("a"), ref("b"), value=f32(3, 7)),
        call("v", "aten.view.default", ref("c"), (21,), value=f32(21)),
        call("loss", "aten.sum.default", ref("v"), value=f32()),
    ), output="loss")
    table = costs(graph, HW)
    assert table["c"].flops == 2 * 3 * 7 * 5
    assert table["v"].alias and table["v"].flops == 0 and table["v"].time_s == 0
    assert table["loss"].flops == 1  # default rule: one FLOP per output element
    assert set(table) == {"c", "v", "loss"}  # placeholders carry no cost


def test_captured_linear_flops(graphs):
    """The rule applies to captured graphs too: every GPT linear is 2*M*N*K."""
    graph, _, _ = graphs["tiny_gpt"]
    table = costs(graph, HW)
    linears = [n for n in graph if n.target == "aten.linear.default"]
    assert linears
    for node in linears:
        x, w = graph[node.args[0].value].spec, graph[node.args[1].value].spec
        assert table[node.name].flops == 2 * (x.numel // x.shape[-1]) * w.shape[0] * w.shape[1]


# ---- liveness -------------------------------------------------------------------------------------

def test_liveness_view_chain():
    """Views keep their base alive: `a` lives until `b` reads it through view -> unsqueeze -> transpose."""
    graph = Graph((
        Node("x", OpKind.INPUT, "x", value=f32(4, 4)),
        call("a", "aten.mul.Tensor", ref("x"), ref("x"), value=f32(4, 4)),
        call("v", "aten.view.default", ref("a"), (16,), value=f32(16)),
        call("u", "aten.unsqueeze.default", ref("v"), 0, value=f32(1, 16)),
        call("t", "aten.transpose.int", ref("u"), 0, 1, value=f32(16, 1)),
        call("c", "aten.mul.Tensor", ref("x"), 2.0, value=f32(4, 4)),
        call("b", "aten.add.Tensor", ref("t"), 1.0, value=f32(16, 1)),
        call("loss", "aten.sum.default", ref("b"), value=f32()),
    ), output="loss")
    lint(graph)
    node_costs = costs(graph, HW)
    roots = storage_roots(graph, node_costs)
    assert roots["v"] == roots["u"] == roots["t"] == "a"
    assert roots["b"] == "b" and roots["c"] == "c"
    last = liveness(graph, node_costs)
    position = {n.name: i for i, n in enumerate(graph)}
    assert last["a"] == position["b"]  # read through the view chain
    assert last["c"] == position["c"]  # never read: dies where it is made
    assert last["x"] == position["c"]
    assert last["loss"] == len(graph)  # the loss lives to the end


# ---- lint -----------------------------------------------------------------------------------------

def test_lint_rejects_use_before_def():
    graph = Graph((
        Node("x", OpKind.INPUT, "x", value=f32(2)),
        call("b", "aten.add.Tensor", ref("a"), 1.0, value=f32(2)),
        call("a", "aten.mul.Tensor", ref("x"), 2.0, value=f32(2)),
        call("loss", "aten.sum.default", ref("b"), value=f32()),
    ), output="loss")
    with pytest.raises(PlanError, match="node b reads a before it is defined"):
        lint(graph)


def test_lint_rejects_undefined_duplicate_and_bad_output():
    x = Node("x", OpKind.INPUT, "x", value=f32(2))
    loss = call("loss", "aten.sum.default", ref("x"), value=f32())
    with pytest.raises(PlanError, match="reads nowhere before it is defined"):
        lint(Graph((x, call("loss", "aten.sum.default", ref("nowhere"), value=f32())), output="loss"))
    with pytest.raises(PlanError, match="node name x appears twice"):
        lint(Graph((x, x, loss), output="loss"))
    with pytest.raises(PlanError, match="output missing is not a node"):
        lint(Graph((x, loss), output="missing"))
    with pytest.raises(PlanError, match="not a Python identifier"):
        lint(Graph((x, call("not-ok", "aten.sum.default", ref("x"), value=f32())), output="not-ok"))
    lint(Graph((x, loss), output="loss"))  # and the fixed graph passes
