"""Resident gradients freed at their step (NOTE: [Resident gradients freed at their step] in
solver/footprint.py): where resident steps run beside backward, a resident stage's gradients go
after B(s-2) instead of at the next step's start. The plan counts them for three windows, the
schedule frees them there and verifies at the plan's peak, and the runtime drops them there while
its losses and weights stay eager's and torch.optim.AdamW's. Exact clipping keeps them."""

from __future__ import annotations

import dataclasses

import pytest

from lazytrain import hardware
from lazytrain.errors import PlanError, ScheduleMismatch
from lazytrain.ir.events import Kind, Phase
from lazytrain.ir.placement import Step
from lazytrain.pipeline import analyse
from lazytrain.solver.footprint import resident_grad_bytes
from lazytrain.solver.solve import evaluate, smallest_budget, solve
from checks import assert_adamw_weights, assert_previous_norm_steps, bind_source, check_replay
from models import tiny_gpt_pair
from plans import decisions, forced

# steps beside backward need a measured pace (the cpu profile has none: every step after backward),
# and steps that fit the tiny model's windows
HW = dataclasses.replace(hardware.load("cpu"), gpu_step_lost=0.25, gpu_step_pace=0.35, gpu_adamw_params_per_s=1e15)
HP = dict(lr=1e-3, eps=1e-6)
SPEC = ["-rk", "-rk", "-Rk", "-rk", "-rk"]  # all resident


def freeing(spec=SPEC, stages=(2, 3, 4)) -> list:
    """`decisions(spec)` with `stages` freeing their gradients after B(s-2)."""
    frees = Step.resident(frees_grads=True)
    return [dataclasses.replace(d, step=frees) if s in stages else d for s, d in enumerate(decisions(spec))]


@pytest.fixture(scope="module")
def gpt():
    meta, real, batch = tiny_gpt_pair()
    graph, stages = analyse(meta, batch, HW)
    return graph, dataclasses.replace(stages, clipping="off"), batch, real


def test_the_plan_counts_a_resident_gradient_until_b_s_minus_2(gpt):
    _, stages, _, _ = gpt
    off = evaluate(stages, HW, 1 << 40, freeing())
    exact = evaluate(stages, HW, 1 << 40, decisions(SPEC))
    M = stages.master_bytes
    grad = [resident_grad_bytes(g.param_bytes, g.param_numel, M) for g in stages]
    S = len(stages)
    freed = sum(grad[2:])
    assert freed > 0
    # after backward (the tail) none of stages 2.. holds a gradient
    assert exact.windows[-1][1] - off.windows[-1][1] == freed
    # in B(k) the gradients of stages k+3 and above are gone
    label = {w[0]: w[1] for w in off.windows}
    label_exact = {w[0]: w[1] for w in exact.windows}
    for k in range(S):
        gone = sum(grad[s] for s in range(max(2, k + 3), S))
        assert label_exact[f"B{k}"] - label[f"B{k}"] == gone, k


def test_the_schedule_frees_them_after_b_s_minus_2_at_the_plans_peak(gpt):
    graph, stages, batch, _ = gpt
    f = forced(graph, stages, batch, freeing(), HW)  # verifies at exactly the predicted peak
    events = f.schedule.events
    assert {e.stage for e in events if e.kind is Kind.FREE and e.frees == (f"rgrad:{e.stage}",)} == {2, 3, 4}
    for s in (2, 3, 4):
        free = next(e for e in events if e.kind is Kind.FREE and e.frees == (f"rgrad:{s}",))
        step = next(e for e in events if e.kind is Kind.OPT_STEP and e.stage == s)
        after = next(e for e in events if e.kind is Kind.COMPUTE and e.phase is Phase.BWD and e.stage == s - 2)
        assert step.id < after.id < free.id
        if s > 2:
            assert free.id < next(e.id for e in events if e.kind is Kind.COMPUTE and e.phase is Phase.BWD and e.stage == s - 3)
    assert "Step.resident(frees_grads=True)" in f.source_text


def test_exact_clipping_and_the_first_two_stages_cannot_free_them(gpt):
    _, stages, _, _ = gpt
    with pytest.raises(PlanError):
        evaluate(dataclasses.replace(stages, clipping="exact"), HW, 1 << 40, freeing())
    with pytest.raises(PlanError):
        evaluate(stages, HW, 1 << 40, freeing(stages=(1,)))
    assert not any(d.step.frees_grads for d in solve(dataclasses.replace(stages, clipping="exact"), HW, 1 << 40).decisions)


def test_the_solver_frees_them_where_memory_binds(gpt):
    _, stages, _, _ = gpt
    kept = evaluate(stages, HW, 1 << 40, decisions(SPEC))
    hw = dataclasses.replace(HW, host_memory_bytes=kept.host_bytes)  # no room on the host to stream a block
    least = smallest_budget(stages, hw)
    assert least < smallest_budget(stages, dataclasses.replace(hw, gpu_step_pace=0.0))  # none may free them
    assert any(d.step.frees_grads for d in solve(stages, hw, least).decisions)


def test_deadlines_the_optimizer_stream_cannot_meet_refuse_the_plan(gpt):
    """A step slower than the windows between B(s) and the end of B(s-2) cannot free its gradients there."""
    _, stages, _, _ = gpt
    slow = dataclasses.replace(HW, gpu_adamw_params_per_s=1.0)
    evaluate(stages, slow, 1 << 40, decisions(SPEC))
    with pytest.raises(PlanError):
        evaluate(stages, slow, 1 << 40, freeing())


def test_replay_and_steps_equal_eager_and_the_gradients_go(gpt):
    graph, stages, batch, real = gpt
    text = forced(graph, stages, batch, freeing(), HW).source_text
    check_replay(text, real, batch)  # without a step the gradients stay for `.grad`
    trainer, model = bind_source(text, real, **HP)
    names = {p for s in trainer.stages if s.index in trainer.grads_freed for p in s.params}
    held = {}
    free = trainer.gradients.free_issued

    def spy(frees):
        free(frees)
        for name in frees:
            idx = name.partition(":")[2]
            if idx.isdigit() and int(idx) in trainer.grads_freed:
                for p in trainer.stages[int(idx)].params:
                    held[p] = trainer.store.home[p].grad
    trainer.gradients.free_issued = spy
    for _ in range(3):
        trainer.step(batch)
    trainer.synchronize()
    assert names and set(held) == names and all(g is None for g in held.values())
    assert_adamw_weights(model, real, batch, 3, **HP)


def test_previous_norm_clipping_leaves_the_first_step_unclipped(gpt):
    """Every step clipped by the previous step's norm; the first, with none yet, not clipped: its
    resident steps cannot wait for this step's norm once their gradients are gone."""
    graph, stages, batch, real = gpt
    text = forced(graph, dataclasses.replace(stages, clipping="previous-norm"), batch, freeing(), HW).source_text
    assert_previous_norm_steps(text, real, batch, 0.05, **HP)


def test_serial_optimizer_refuses_such_a_schedule(gpt):
    graph, stages, batch, real = gpt
    text = forced(graph, stages, batch, freeing(), HW).source_text
    with pytest.raises(ScheduleMismatch, match="serial_optimizer"):
        bind_source(text, real, serial_optimizer=True)
