"""Capture does not depend on Python's hash seed (NOTE: [Hash-seed independent capture] in
ir/canonical.py).

Models that loop over `set(config.layer_types)` (Gemma 3's rotary embeddings, one per layer type;
dots1's attention masks) are traced in an order that changes with PYTHONHASHSEED. Their graphs must
come out the same, node for node, in every process, so that a resumed run recognises its model;
a graph without such a loop keeps the order and names export gave it.
"""

import json
import os
import subprocess
import sys
from pathlib import Path

import torch
from torch import nn

from lazytrain.ir.canonical import canonical_order
from lazytrain.ir.capture import capture

SEEDS = ("1", "2", "3", "4")

CAPTURE = """
import json, torch, transformers as T
from lazytrain.ir.capture import capture
from lazytrain.ir.model_file import build_on_meta
from lazytrain.ir.dump import structural_text

common = dict(vocab_size=512, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=32, sliding_window=8, use_cache=False,
              layer_types=["sliding_attention", "full_attention"])
models = {
    "gemma3": lambda: T.Gemma3ForCausalLM(T.Gemma3TextConfig(head_dim=8, **common)),
    "dots1": lambda: T.Dots1ForCausalLM(T.Dots1Config(moe_intermediate_size=16, n_routed_experts=2,
                                                      num_experts_per_tok=1, first_k_dense_replace=2, **common)),
}
ids = torch.zeros(2, 32, dtype=torch.long)
out = {}
for name, build in models.items():
    graph = capture(build_on_meta(build), {"input_ids": ids, "labels": ids})
    out[name] = [graph.fingerprint(), structural_text(graph)]
print(json.dumps(out))
"""


def test_hf_models_looping_over_a_set_capture_the_same_in_every_process():
    """Gemma 3 (rotary embeddings) and dots1 (masks), each captured under four hash seeds: one
    graph, one fingerprint."""
    root = Path(__file__).parent.parent
    runs = {}
    for seed in SEEDS:
        env = dict(os.environ, PYTHONHASHSEED=seed, TRANSFORMERS_VERBOSITY="error")
        done = subprocess.run([sys.executable, "-c", CAPTURE], cwd=root, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr
        runs[seed] = json.loads(done.stdout.strip().splitlines()[-1])
    for name in ("gemma3", "dots1"):
        first = runs[SEEDS[0]][name]
        for seed in SEEDS[1:]:
            assert runs[seed][name][0] == first[0], (name, seed)
            assert runs[seed][name][1] == first[1], (name, seed)


class PerKind(nn.Module):
    """One scale per kind, applied in the order a set of the kinds iterates (as Gemma 3 does)."""

    def __init__(self):
        super().__init__()
        for kind in ("full", "local"):
            self.register_buffer(f"{kind}_scale", torch.tensor([1.0, 2.0]) + len(kind))

    def forward(self, x, y, order=("full", "local")):
        parts = {kind: (x * getattr(self, f"{kind}_scale")).sin() for kind in order}
        return ((parts["full"] - parts["local"] - y) ** 2).mean()


class Kinds(nn.Module):
    def __init__(self, order):
        super().__init__()
        self.inner, self.order = PerKind(), order

    def forward(self, x, y):
        return self.inner(x, y, self.order)


def test_iterations_come_out_in_the_models_buffer_order():
    """The two iterations, traced in either order, come out the same: the one reading the
    first-registered buffer first, its nodes named first."""
    batch = {"x": torch.randn(3, 2), "y": torch.randn(3, 2)}
    with torch.device("meta"):
        a, b = Kinds(("full", "local")), Kinds(("local", "full"))
    ga, gb = capture(a, batch), capture(b, batch)
    assert ga.nodes == gb.nodes and ga.fingerprint() == gb.fingerprint()
    reads = [n.args[1].value for n in ga.nodes if n.target == "aten.mul.Tensor"]
    assert reads == ["b_inner_full_scale", "b_inner_local_scale"]


def test_separate_data_keeps_the_trace_order():
    """Pieces of one line that read different data (`return cos.to(dtype), sin.to(dtype)` in a
    rotary embedding) are not iterations of a loop: they stay as traced."""
    graph = torch.fx.Graph()
    x = graph.placeholder("x")
    sin = graph.call_function(torch.ops.aten.sin.default, (x,))
    cos = graph.call_function(torch.ops.aten.cos.default, (x,))
    casts = [graph.call_function(torch.ops.aten.neg.default, (op,)) for op in (cos, sin)]
    for line, node in ((3, sin), (4, cos), (5, casts[0]), (5, casts[1])):
        node.meta["stack_trace"] = f'File "m.py", line {line}, in forward\n    ...\n'
    order, renames = canonical_order([sin, cos, *casts], {"x": "x"}, {})
    assert order == [sin, cos, *casts] and renames == {}
