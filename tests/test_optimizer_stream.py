"""Device optimizer steps beside backward (NOTE: [Device steps beside compute] in hardware/__init__.py):
a resident stage's step is released as its backward ends and runs on the optimizer stream, costing
compute `gpu_step_lost` of its time while backward runs and its whole time after backward; the
stream advances at `gpu_step_pace` beside compute. Exact clipping keeps every step after backward."""

import dataclasses

import pytest

from lazytrain import hardware
from lazytrain.ir.plan import OutMode, StageDecision
from lazytrain.passes.footprint import gpu_step_s
from lazytrain.passes.solve import evaluate
from lazytrain.pipeline import analyse
from models import tiny_gpt_pair

BUDGET = 1 << 34


def _resident(clipping: str, lost: float, pace: float):
    meta, _, batch = tiny_gpt_pair()
    hw = dataclasses.replace(hardware.load("cpu"), gpu_step_lost=lost, gpu_step_pace=pace)
    _, stages = analyse(meta, batch, hw)
    stages = dataclasses.replace(stages, clipping=clipping)
    plan = evaluate(stages, hw, BUDGET, [StageDecision(False, False, OutMode.KEEP) for _ in stages])
    M = stages.master_bytes
    steps = [gpu_step_s(g.param_numel, len(g.params), hw, M) for g in stages]
    shared = gpu_step_s(stages.shared_numel, len(stages.shared_params), hw, M)
    base = plan.compute_s + plan.recompute_s
    return plan, base, steps, shared


def test_steps_beside_backward_cost_their_lost_share_and_the_last_ones_run_after_it():
    plan, base, steps, shared = _resident("off", lost=0.25, pace=1e6)
    # every stage's step but the first stage's runs beside the backward after its own
    expected = base + 0.25 * sum(steps[1:]) + steps[0] + shared
    assert plan.step_s == pytest.approx(expected, rel=1e-6)
    assert plan.optimizer_s == pytest.approx(expected - base, rel=1e-6)
    assert plan.step_s < base + sum(steps) + shared


def test_a_stream_that_cannot_advance_beside_compute_runs_every_step_after_backward():
    plan, base, steps, shared = _resident("off", lost=0.25, pace=1e-9)
    assert plan.step_s == pytest.approx(base + sum(steps) + shared, rel=1e-5)


@pytest.mark.parametrize("clipping", ["exact", "previous-norm"])
def test_exact_clipping_keeps_every_step_after_backward(clipping):
    plan, base, steps, shared = _resident(clipping, lost=0.25, pace=1e6)
    serial = base + sum(steps) + shared
    if clipping == "exact":
        assert plan.step_s == pytest.approx(serial, rel=1e-6)
    else:  # steps clipped by the last step's norm run during backward, as unclipped ones
        assert plan.step_s == pytest.approx(base + 0.25 * sum(steps[1:]) + steps[0] + shared, rel=1e-6)


def test_profiles_without_a_measurement_keep_steps_in_series():
    hw = hardware.load("cpu")
    assert (hw.gpu_step_lost, hw.gpu_step_pace) == (1.0, 0.0)
    plan, base, steps, shared = _resident("off", lost=1.0, pace=0.0)
    assert plan.step_s == pytest.approx(base + sum(steps) + shared, rel=1e-6)
