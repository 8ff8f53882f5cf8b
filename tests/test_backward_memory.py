"""What a stage's backward and a recomputed forward hold, against the allocations the device made.

The H200 figures (bench/stage_memory.py, bench/results/stage_memory/qwen2.5-7b_layer.txt, 2026-12-01): a Qwen2.5-7B layer's
backward holds 75776 bytes a token beyond what it saved and its weights' gradients (two of the MLP's
intermediates' gradients); its forward without autograd peaks at 7.375 GiB at 1 x 65536 tokens,
before its output exists.
"""

from __future__ import annotations

import torch

from lazytrain import hardware
from lazytrain.ir.events import Kind, Phase
from lazytrain.pipeline import analyse, compile_model
from lazytrain.solver.footprint import backward_workspace, forward_workspace
from models import hf_config, model_pair, token_batch

HW = hardware.load("cpu")


def _qwen(hidden: int = 32, intermediate: int = 512, layers: int = 2, batch: int = 2, seq: int = 16):
    from transformers import Qwen2ForCausalLM

    cfg = hf_config("qwen2", layers=layers, hidden=hidden)
    cfg.intermediate_size = intermediate
    meta, _ = model_pair(lambda: Qwen2ForCausalLM(cfg).to(torch.bfloat16))
    return meta, token_batch(batch, seq, cfg.vocab_size)


def test_a_residual_add_hands_its_gradient_through_without_a_copy():
    """NOTE: [Gradients handed through] in analysis/backward.py. With the MLP four times wider than
    anything else the layer's backward peaks at the MLP's product: its gradient is replaced by those
    of the activation and the up projection. The residual stream's gradient is the layer output's
    own (a buffer counted apart): counting a copy of it put every 7B backward window 448 MiB over
    the measured one at 1 x 65536."""
    meta, batch = _qwen()
    _, stages = analyse(meta, batch, HW)
    layer = next(g for g in stages if g.name == "model.layers.1")
    tokens, mlp = 2 * 16, 512
    assert backward_workspace(layer) == 2 * tokens * mlp * 2


def test_the_gradient_of_outputs_read_without_gradient_is_made_by_the_stage_that_takes_one():
    """Every layer reads the prologue's rotary tables, and only the first layer its hidden states:
    the prologue's output gradient is made in the first layer's backward, not the last one's."""
    meta, batch = _qwen(layers=3)
    _, stages = analyse(meta, batch, HW)
    assert stages[0].consumers[-1] == 3 and stages.grad_maker(0) == 1
    assert stages.grad_maker(1) == 2  # a layer's output: the next layer takes its gradient
    schedule = compile_model(meta, batch, None, HW).schedule
    makers = [e for e in schedule.events if "grad:0" in e.allocs]
    assert [(e.stage, e.phase) for e in makers] == [(1, Phase.BWD)]


def test_a_forward_without_autograd_holds_its_liveness_peak_with_its_outputs_in_it():
    """The forward's workspace beside its outputs' buffer adds up to its liveness peak, which
    counts the outputs from the node that makes them."""
    meta, batch = _qwen()
    _, stages = analyse(meta, batch, HW)
    layer = next(g for g in stages if g.name == "model.layers.1")
    assert forward_workspace(layer) + layer.out_bytes == layer.peak_bytes
    compiled = compile_model(meta, batch, "min", HW)
    recomputed = [e for e in compiled.schedule.events if e.kind is Kind.COMPUTE and e.phase is Phase.FWD
                  and compiled.plan.decisions[e.stage].recomputed and compiled.stages[e.stage].consumers]
    assert recomputed
    for e in recomputed:
        assert e.workspace + compiled.stages[e.stage].out_bytes == compiled.stages[e.stage].peak_bytes
