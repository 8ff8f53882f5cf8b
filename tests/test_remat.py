"""Recompute before backward leaves out what no backward reads (NOTE: [Skipped recompute]).

- Which linears a stage skips: a transformer layer's down_proj, never a linear whose output a
  backward formula reads (through any chain of operators).
- Replays of all-recompute plans, with those linears run as `grad_only_linear`, give eager
  PyTorch's loss and gradients; the recompute's predicted time is the forward less the skips.
"""

from __future__ import annotations

import pytest
import torch

from lazytrain import hardware
from lazytrain.pipeline import analyse
from lazytrain.runtime.remat import grad_only_linear
from checks import check_replay
from models import BlockSpec, hf_pair, random_block_model
from plans import decisions, forced

HW = hardware.load("cpu")


def _weight_of(graph, node: str) -> str:
    return graph[graph[node].args[1].value].target


@pytest.mark.parametrize("family", ["qwen2", "llama"])
def test_decoder_layers_skip_down_proj_and_replay_equals_eager(family):
    meta, real, batch = hf_pair(family, layers=3)
    graph, stages = analyse(meta, batch, HW)
    layers = [s for s in stages if s.name.startswith("model.layers.")]
    assert len(layers) == 3
    for s in layers:
        assert [_weight_of(graph, n) for n in s.skips] == [f"{s.name}.mlp.down_proj.weight"]
        skipped = s.fwd_s - s.remat_s
        assert 0 < skipped < s.fwd_s
    # every stage recomputed (the loss stage saves): the remat path runs for each layer
    plan = forced(graph, stages, batch, decisions(["-Rk"] * (len(stages) - 1) + ["-rk"]), HW)
    assert f"skips=('{layers[0].skips[0]}',)" in plan.source_text
    assert plan.plan.recompute_s == pytest.approx(sum(s.remat_s for s in stages[:-1]))
    check_replay(plan.source_text, real, batch)


def test_a_linear_whose_output_a_backward_reads_is_not_skipped():
    # "linear" gelu: gelu's backward reads the linear's output; "mlp": x + fc2(act(fc1(x))), where
    # fc1's output feeds relu (which saves its result), and fc2's output is only added.
    meta, real, batch = random_block_model(blocks=(BlockSpec("linear", 16, "gelu"), BlockSpec("mlp", 24, "relu")))
    graph, stages = analyse(meta, batch, HW)
    by_name = {s.name: s for s in stages}
    assert by_name["blocks.0"].skips == ()
    assert [_weight_of(graph, n) for n in by_name["blocks.1"].skips] == ["blocks.1.fc2.weight"]
    plan = forced(graph, stages, batch, decisions(["-Rk"] * (len(stages) - 1) + ["-rk"]), HW)
    check_replay(plan.source_text, real, batch)


@pytest.mark.parametrize("bias", [False, True])
def test_grad_only_linear_backward_is_the_linear_backward(bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 8, generator=g, requires_grad=True)
    w = torch.randn(6, 8, generator=g, requires_grad=True)
    b = torch.randn(6, generator=g, requires_grad=True) if bias else None
    grad = torch.randn(3, 5, 6, generator=g)
    out = grad_only_linear(x, w, b)
    assert out.shape == (3, 5, 6) and out.dtype == x.dtype and not out.any()
    out.backward(grad)
    got = [t.grad.clone() for t in (x, w, b) if t is not None]
    for t in (x, w, b):
        if t is not None:
            t.grad = None
    torch.nn.functional.linear(x, w, b).backward(grad)
    for mine, ref in zip(got, [t.grad for t in (x, w, b) if t is not None]):
        torch.testing.assert_close(mine, ref)
