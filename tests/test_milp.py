"""The MIP back end: HiGHS and CBC find the same optimum, and the plan reads its values right."""

from __future__ import annotations

import pytest

from lazytrain import hardware
from lazytrain.passes import milp
from lazytrain.passes.solve import GAP, evaluate, smallest_budget, solve
from lazytrain.pipeline import analyse
from models import BlockSpec, ModelSpec, random_block_model, tiny_gpt_pair

HW = hardware.load("cpu")


def _cases():
    meta, _, batch = tiny_gpt_pair()
    yield analyse(meta, batch, HW)[1]
    meta, _, batch = random_block_model(ModelSpec((BlockSpec("mlp", 24), BlockSpec("linear", 16), BlockSpec("mlp", 24)),
                                                  table="const"))
    yield analyse(meta, batch, HW)[1]


CASES = list(_cases())


@pytest.mark.skipif(milp.solver_name() != "highs", reason="highspy is not installed")
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("slack", [0.0, 0.1, 0.5, 4.0])
def test_highs_and_cbc_agree(case, slack, monkeypatch):
    """Solved to optimality (gap 0), both solvers reach the same step time, from the smallest budget
    to a roomy one; and each plan's figures are those `evaluate` computes for its decisions."""
    stages = CASES[case]
    budget = int(smallest_budget(stages, HW) * (1 + slack))
    highs = solve(stages, HW, budget, gap=0.0)
    monkeypatch.setenv("LAZYTRAIN_SOLVER", "cbc")
    assert milp.solver_name() == "cbc"
    cbc = solve(stages, HW, budget, gap=0.0)
    assert (highs.solver.solver, cbc.solver.solver) == ("highs", "cbc")
    assert highs.step_s == pytest.approx(cbc.step_s, rel=1e-6)
    for plan in (highs, cbc):
        again = evaluate(stages, HW, budget, list(plan.decisions))
        assert plan.step_s == pytest.approx(again.step_s, rel=1e-6)
        assert plan.peak_bytes <= budget


def test_default_gap_is_reported():
    stages = CASES[1]
    plan = solve(stages, HW, int(smallest_budget(stages, HW) * 1.2))
    assert plan.solver.status == "optimal" and 0.0 <= plan.solver.gap <= GAP
    assert plan.solver.objective_s >= plan.solver.bound_s * (1 - 1e-9)
    assert [name for name, _ in plan.solver.times] == ["model", "handover", "search", "plan"] or plan.solver.solver == "cbc"
