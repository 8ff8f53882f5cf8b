"""GPU steps right after a stage's backward (NOTE: [Backward steps] in solver/step_model.py): the
plan moves the stage's state traffic into backward and drops its host gradient buffer; the schedule
verifies at its predicted peak; replay gives eager's loss and gradients, and steps give
torch.optim.AdamW's weights, unclipped and clipped by the previous step's norm. Exact clipping
refuses them."""

from __future__ import annotations

import dataclasses

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lazytrain import hardware
from lazytrain.errors import PlanError
from lazytrain.ir.events import Kind, Phase, Stream
from lazytrain.ir.placement import Outputs
from lazytrain.pipeline import analyse
from lazytrain.solver.solve import evaluate, solve
from checks import assert_adamw_weights, assert_previous_norm_steps, assert_same_steps, bind_source, check_replay
from models import examples, tiny_gpt_pair
from plans import decisions, forced, repair
from test_forced_plans import check_forced

HW = hardware.load("cpu")
HP = dict(lr=1e-3, eps=1e-6)
SPEC = ["-rk", "GRk", "BRk", "BRk", "-rk"]  # blocks.1 and blocks.2 stepped in backward, blocks.0 at the next forward


@pytest.fixture(scope="module")
def gpt():
    meta, real, batch = tiny_gpt_pair()
    graph, stages = analyse(meta, batch, HW)
    return graph, dataclasses.replace(stages, clipping="off"), batch, real


def test_the_plan_moves_state_traffic_into_backward(gpt):
    """Against stepping at the next forward: no host gradient buffer, no state traffic in forward."""
    _, stages, _, _ = gpt
    forward = evaluate(stages, HW, 1 << 40, decisions(["-rk", "GRk", "GRk", "GRk", "-rk"]))
    backward = evaluate(stages, HW, 1 << 40, decisions(SPEC))
    assert forward.host_bytes - backward.host_bytes == stages[2].param_bytes + stages[3].param_bytes


def test_the_schedule_steps_each_stage_after_its_backward(gpt):
    graph, stages, batch, _ = gpt
    f = forced(graph, stages, batch, decisions(SPEC), HW)
    events = f.schedule.events
    for s in (2, 3):
        fetch = next(e for e in events if e.kind is Kind.PREFETCH and e.stage == s and e.allocs[0] == f"opt:{s}")
        bwd = next(e for e in events if e.kind is Kind.COMPUTE and e.phase is Phase.BWD and e.stage == s)
        step = next(e for e in events if e.kind is Kind.OPT_STEP and e.stage == s)
        back = [e for e in events if e.kind is Kind.OFFLOAD and e.stage == s and e.stream is Stream.D2H]
        assert fetch.id < bwd.id < step.id < min(e.id for e in back)
        assert not any(e.kind is Kind.OFFLOAD and e.reads == (f"g:{s}",) for e in events)  # the gradient stays
        assert step.id > next(e.id for e in events if e.kind is Kind.COMPUTE and e.phase is Phase.FWD and e.stage == 4)
        # freed after the next backward, so compute waits for the step and write-back only past it
        after = next(e.id for e in events if e.kind is Kind.COMPUTE and e.phase is Phase.BWD and e.stage == s - 1)
        frees = [e.id for e in events if e.kind is Kind.FREE and e.frees[0] in (f"w:{s}", f"opt:{s}", f"g:{s}")
                 and e.id > bwd.id]
        assert len(frees) == 3 and min(frees) > after


def test_replay_and_steps_equal_eager(gpt):
    graph, stages, batch, real = gpt
    text = forced(graph, stages, batch, decisions(SPEC), HW).source_text
    check_replay(text, real, batch)
    trainer, model = bind_source(text, real, **HP)
    for _ in range(3):
        trainer.step(batch)
    trainer.synchronize()
    assert_adamw_weights(model, real, batch, 3, **HP)


def test_previous_norm_clipping(gpt):
    """Every step clipped by the previous step's norm, as torch would with that coefficient; the
    first, with none yet, not clipped."""
    graph, stages, batch, real = gpt
    text = forced(graph, dataclasses.replace(stages, clipping="previous-norm"), batch, decisions(SPEC), HW).source_text
    assert_previous_norm_steps(text, real, batch, 0.05, **HP)


def test_exact_clipping_refuses_backward_steps(gpt):
    _, stages, _, _ = gpt
    with pytest.raises(PlanError):
        evaluate(dataclasses.replace(stages, clipping="exact"), HW, 1 << 40, decisions(SPEC))
    plan = solve(dataclasses.replace(stages, clipping="exact"), HW, 1 << 40)
    assert not any(d.kind == "backward" for d in plan.decisions)


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_decisions_with_backward_steps(gpt, data):
    """Any valid vector with steps in backward: verified at its predicted peak, eager's loss and gradients."""
    graph, stages, batch, real = gpt
    raw = data.draw(st.lists(st.tuples(st.booleans(), st.booleans(), st.sampled_from(list(Outputs)), st.booleans(),
                                       st.booleans(), st.booleans()), min_size=len(stages), max_size=len(stages)))
    check_forced(graph, stages, batch, real, repair(stages, raw))


def test_a_step_in_backward_holds_twins_of_its_largest_tensor_only(gpt):
    """NOTE: [Backward step twins] in solver/footprint.py: the `opt:S` buffer of a stage stepped in
    backward holds its master, states and the fp32 twins of its largest tensor, not of the whole stage."""
    from lazytrain.solver.footprint import backward_step_bytes, gpu_step_bytes

    graph, stages, batch, _ = gpt
    schedule = forced(graph, stages, batch, decisions(SPEC), HW).schedule
    buffers = {b.name: b.bytes for b in schedule.buffers}
    for s in (2, 3):
        g = stages[s]
        assert buffers[f"opt:{s}"] == backward_step_bytes(g.param_bytes, g.param_numel, stages.state_bytes, stages.master_bytes,
                                                          g.largest_numel)
        assert buffers[f"opt:{s}"] < gpu_step_bytes(g.param_bytes, g.param_numel, stages.state_bytes,
                                                    stages.master_bytes, g.largest_numel) - 4 * (g.param_numel - g.largest_numel)
    assert buffers["opt:1"] == gpu_step_bytes(stages[1].param_bytes, stages[1].param_numel, stages.state_bytes,
                                              stages.master_bytes, stages[1].largest_numel)


@pytest.mark.parametrize("chunk", [None, 1024])
@pytest.mark.parametrize("states", ["32bit", "8bit"])
def test_bf16_masters_step_in_backward_as_at_the_prefetch(tmp_path, monkeypatch, states, chunk):
    """bf16 masters, each tensor stepped through the update's twins (NOTE: [Backward step twins]),
    whole or (`chunk`) in pieces of 1024 elements: 3 steps give the weights the same stages stepped
    at the next prefetch give, to the bit."""
    import torch

    from lazytrain.runtime import gpu_step, optim

    if chunk is not None:  # the tiny model's 3072-element tensors step in 3 pieces
        monkeypatch.setattr(optim, "TWIN_CHUNK", chunk)
        monkeypatch.setattr(gpu_step, "TWIN_CHUNK", chunk)

    meta, real, batch = tiny_gpt_pair()
    meta, real = meta.to(torch.bfloat16), real.to(torch.bfloat16)
    graph, stages = analyse(meta, batch, HW, optimizer_states=states, master_weights="bf16")
    stages = dataclasses.replace(stages, clipping="off")
    texts = [forced(graph, stages, batch, decisions(spec), HW).source_text
             for spec in (["-rk", "GRk", "GRk", "GRk", "-rk"], SPEC)]
    assert_same_steps(texts, real, batch, tmp_path, **HP)
