"""The MIP back end: HiGHS and CBC find the same optimum, and the plan reads its values right."""

from __future__ import annotations

import dataclasses

import mip
import torch
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from lazytrain import hardware
from lazytrain.errors import PlanError
from lazytrain.ir.placement import Internals, Outputs, Placement, PlacementError, Step, Weights
from lazytrain.pipeline import analyse
from lazytrain.solver import milp
from lazytrain.solver.formulation import _build
from lazytrain.solver.solve import GAP, evaluate, smallest_budget, solve
from models import BlockSpec, ModelSpec, examples, random_block_model, tiny_gpt_pair

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
    names = [name for name, _ in plan.solver.times]
    assert names in (["model", "handover", "search", "plan"], ["model", "handover", "search", "of which presolve", "plan"]) \
        or plan.solver.solver == "cbc"


# the CPU profile's link hides every transfer of these small cases; a slow one exposes them
SLOW = dataclasses.replace(HW, h2d_bandwidth=HW.h2d_bandwidth / 200, d2h_bandwidth=HW.d2h_bandwidth / 200,
                           duplex_bandwidth=HW.duplex_bandwidth / 200)


def _optimum(stages, hw, budget, *, cuts, fixed=None, relax=False):
    m, _, model, exposed = _build(stages, hw, budget, minimise_memory=False, fixed=fixed, cuts=cuts)
    if relax:
        for var in m.vars:
            var.var_type = mip.CONTINUOUS
    r = milp.optimize(m, 60.0, 0.0)
    if not r.found:
        return None, len(m.constrs), 0.0
    return r.objective * model.unit_s, len(m.constrs), sum(milp.value(e, r) for e in exposed)


@pytest.mark.parametrize("hw", [HW, SLOW], ids=["cpu", "slow-link"])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("slack", [0.0, 0.3, 4.0])
def test_exposure_cuts_keep_the_optimum(hw, case, slack):
    """The rows of NOTE: [Exposure cuts] cut off no plan: solved to optimality, the step time is the
    same with and without them, and their relaxation is at least as tight."""
    stages = CASES[case]
    budget = int(smallest_budget(stages, hw) * (1 + slack))
    (with_cuts, rows, _), (without, rows0, _) = (_optimum(stages, hw, budget, cuts=True),
                                                 _optimum(stages, hw, budget, cuts=False))
    assert rows > rows0  # the case has cuts to test
    assert with_cuts == pytest.approx(without, rel=1e-6)
    lp = _optimum(stages, hw, budget, cuts=True, relax=True)[0]
    lp0 = _optimum(stages, hw, budget, cuts=False, relax=True)[0]
    assert lp >= lp0 * (1 - 1e-9)


def _placements() -> list[Placement]:
    """Every placement of resident or streamed weights (fetched 1 or 2 windows ahead), saved or
    recomputed internals, any outputs, stepped on the device, on the host or at the prefetch, that
    constructs (a stage's axes agree)."""
    out = []
    for weights in (Weights(), Weights(streamed=True), Weights(streamed=True, lookahead=2)):
        for internals in Internals:
            for outputs in Outputs:
                for step in (Step.resident(), Step.host(), Step.at_prefetch()):
                    try:
                        out.append(Placement(weights, internals, outputs, step))
                    except PlacementError:
                        continue
    return out


PLACEMENTS = _placements()


def _any_decisions(data, stages) -> list[Placement]:
    """Any decision vector, a valid plan or not (the rules across stages, and a lookahead of 2 at the
    first two, are the solver's): the models with and without extra rows must agree on it."""
    return [data.draw(st.sampled_from(PLACEMENTS)) for _ in stages]


@settings(max_examples=examples(60), deadline=None)
@given(data=st.data())
def test_exposure_cuts_keep_every_plans_value(data):
    """For any decision vector, fixed, the model with the cuts gives the value (or the refusal) the
    model without them gives: a cut that removed a valid plan, or priced it higher, fails here."""
    stages = CASES[data.draw(st.integers(0, len(CASES) - 1))]
    hw = data.draw(st.sampled_from([HW, SLOW]))
    decs = _any_decisions(data, stages)
    budget = int(smallest_budget(stages, hw) * data.draw(st.sampled_from([1.0, 1.5, 10.0])))
    with_cuts, _, _ = _optimum(stages, hw, budget, cuts=True, fixed=decs)
    without, _, exposed = _optimum(stages, hw, budget, cuts=False, fixed=decs)
    assert (with_cuts is None) == (without is None)
    if without is not None:
        assert with_cuts == pytest.approx(without, rel=1e-7, abs=1e-12)
        event("exposed" if exposed > 0 else "hidden")


def test_exposure_cuts_tighten_a_link_bound_relaxation():
    """Where the link is the bottleneck, the cuts raise the relaxation's bound (what they are for)."""
    stages = CASES[0]
    budget = int(smallest_budget(stages, SLOW) * 1.3)
    lp = _optimum(stages, SLOW, budget, cuts=True, relax=True)[0]
    lp0 = _optimum(stages, SLOW, budget, cuts=False, relax=True)[0]
    assert lp > lp0 * (1 + 1e-4)


def _optimum_cliques(stages, hw, budget, *, cliques, fixed=None, relax=False):
    """`_optimum` with or without the rows of NOTE: [Memory cliques] (the exposure cuts kept)."""
    import lazytrain.solver.cuts as cuts_mod
    real = cuts_mod.memory_clique
    try:
        if not cliques:
            cuts_mod.memory_clique = lambda *a: None
        return _optimum(stages, hw, budget, cuts=True, fixed=fixed, relax=relax)
    finally:
        cuts_mod.memory_clique = real


@pytest.mark.parametrize("hw", [HW, SLOW], ids=["cpu", "slow-link"])
@pytest.mark.parametrize("case", range(len(CASES)))
@pytest.mark.parametrize("slack", [0.0, 0.1, 0.3, 4.0])
def test_memory_cliques_keep_the_optimum(hw, case, slack):
    """The rows of NOTE: [Memory cliques] cut off no plan that fits: solved to optimality, the step
    time is the same with and without them, and their relaxation is at least as tight."""
    stages = CASES[case]
    budget = int(smallest_budget(stages, hw) * (1 + slack))
    with_rows, rows, _ = _optimum_cliques(stages, hw, budget, cliques=True)
    without, rows0, _ = _optimum_cliques(stages, hw, budget, cliques=False)
    assert rows > rows0 or slack > 1  # near the smallest budget the case has clique rows to test
    assert with_rows == pytest.approx(without, rel=1e-6)
    lp = _optimum_cliques(stages, hw, budget, cliques=True, relax=True)[0]
    lp0 = _optimum_cliques(stages, hw, budget, cliques=False, relax=True)[0]
    assert lp >= lp0 * (1 - 1e-9)


@settings(max_examples=examples(60), deadline=None)
@given(data=st.data())
def test_memory_cliques_keep_every_plans_value(data):
    """For any decision vector, fixed, the model with the clique rows gives the value (or the
    refusal) the model without them gives."""
    stages = CASES[data.draw(st.integers(0, len(CASES) - 1))]
    hw = data.draw(st.sampled_from([HW, SLOW]))
    decs = _any_decisions(data, stages)
    budget = int(smallest_budget(stages, hw) * data.draw(st.sampled_from([1.0, 1.1, 1.5, 10.0])))
    with_rows, _, _ = _optimum_cliques(stages, hw, budget, cliques=True, fixed=decs)
    without, _, _ = _optimum_cliques(stages, hw, budget, cliques=False, fixed=decs)
    assert (with_rows is None) == (without is None)
    if without is not None:
        assert with_rows == pytest.approx(without, rel=1e-7, abs=1e-12)


@pytest.mark.parametrize("hw", [HW, SLOW], ids=["cpu", "slow-link"])
@pytest.mark.parametrize("case", range(len(CASES)))
def test_memory_clique_pairs_never_fit(hw, case, monkeypatch):
    """Every two decisions a clique row of NOTE: [Memory cliques] forbids together really break the
    budget: the model without the rows, with both pinned on, has no plan."""
    import itertools

    import lazytrain.solver.cuts as cuts_mod
    stages = CASES[case]
    budget = int(smallest_budget(stages, hw) * 1.1)
    cliques, real = [], cuts_mod.memory_clique

    def spy(m, row, cap):
        n = len(m.constrs)
        real(m, row, cap)
        cliques.extend([var.name for var in c.expr.expr] for c in m.constrs[n:])
    monkeypatch.setattr(cuts_mod, "memory_clique", spy)
    _build(stages, hw, budget, minimise_memory=False)
    monkeypatch.setattr(cuts_mod, "memory_clique", lambda *a: None)
    pairs = {tuple(sorted(p)) for c in cliques for p in itertools.combinations(c, 2)}
    assert pairs
    for a, b in sorted(pairs):
        m, *_ = _build(stages, hw, budget, minimise_memory=False)
        m += m.var_by_name(a) + m.var_by_name(b) == 2
        assert not milp.optimize(m, 60.0, 0.0).found, (a, b)


def test_plan_windows_are_the_bytes_the_schedule_holds():
    """A plan's per-window bytes are read from the solver's values; variables that rows bound only
    from below (NOTE: [Floor variables]) must sit at their least, or a window reads up to the whole
    budget. Seen after an earlier solve in the same process left HiGHS there: a tiny bf16-master
    plan reported a window of 24 GiB - 512 B."""
    from lazytrain.pipeline import compile_model

    stages = CASES[0]
    solve(stages, HW, int(smallest_budget(stages, HW)), gap=0.0)
    meta, _, batch = tiny_gpt_pair()
    compiled = compile_model(meta.to(torch.bfloat16), batch, None, HW, master_weights="bf16")
    assert max(compiled.memory_trace) <= compiled.plan.peak_bytes <= 1.2 * max(compiled.memory_trace)  # the plan counts a little more
    # where the solver lands on its optimal face is luck: the objective must hold every floor down
    m, v, model, _ = _build(compiled.stages, HW, 1 << 40, minimise_memory=False)
    weights = m.objective.expr
    assert v["R"] and all(weights.get(x, 0.0) > 0 for x in [*v["R"], *model.floors])


def _host_work(jobs, caps, costs, *, split: bool, deadlines: bool = False) -> float:
    """The least sum over the windows of costs[w] * done[w] + max(0, done[w] - caps[w]), where each
    job (release, due, seconds) runs in windows release..due (due: the last window, unless
    `deadlines`): through `backlog.backlog`, or (`split`) one part per (job, window) as each
    stage's own split would place it."""
    from lazytrain.solver.backlog import backlog

    n = len(caps)
    windows = list(range(n))
    m = mip.Model(sense=mip.MINIMIZE, solver_name=mip.CBC)
    m.verbose = 0
    one = m.add_var("one", lb=1.0, ub=1.0)  # makes each amount a linear expression, as in the step model
    if split:
        done = {w: 0.0 for w in windows}
        for release, due, amount in jobs:
            parts = [m.add_var(lb=0.0) for _ in windows[release:due + 1]]
            m += mip.xsum(parts) == amount * one
            for w, p in zip(windows[release:due + 1], parts):
                done[w] = done[w] + p
    else:
        rel, dues = [0.0] * n, [0.0] * n
        for release, due, amount in jobs:
            rel[release] = rel[release] + amount * one
            dues[due] = dues[due] + amount * one
        done = backlog(m, rel, windows, 0.5, dues if deadlines else None)
    over = [m.add_var(lb=0.0) for _ in windows]
    for o, w in zip(over, windows):
        m += o >= done.get(w, 0.0) - caps[w]
    m.objective = mip.minimize(mip.xsum(costs[w] * done.get(w, 0.0) for w in windows) + mip.xsum(over))
    r = milp.optimize(m, 60.0, 0.0)
    assert r.found
    return r.objective


def _solver_slack(jobs) -> float:
    """How far two optima of `_host_work` may differ from the solver's feasibility tolerance alone
    (1e-7 a unit of work moved, at costs of magnitude at most 1): a draw of costs near 1e-7 otherwise
    tells the formulations apart by rounding (0.5000001788 against 0.5000001192)."""
    return 1e-7 * (1.0 + sum(amount for *_, amount in jobs))


@settings(max_examples=examples(60), deadline=None)
@given(data=st.data())
def test_host_step_backlog_places_work_as_a_split_does(data):
    """NOTE: [Host step backlog]: the backlog reaches exactly the per-window host work that splitting
    each release over its own windows reaches, so every linear price of it has the same optimum."""
    n = data.draw(st.integers(1, 7))
    amount = st.one_of(st.just(0.0), st.floats(0.01, 5.0))
    released = data.draw(st.lists(amount, min_size=n, max_size=n))
    released[-1] = released[-1] or 0.5  # the last window always has some (the tail: the first stages' steps)
    caps = data.draw(st.lists(st.floats(0.0, 3.0), min_size=n, max_size=n))
    costs = data.draw(st.lists(st.floats(-1.0, 1.0), min_size=n, max_size=n))
    jobs = [(w, n - 1, a) for w, a in enumerate(released) if a]
    a = _host_work(jobs, caps, costs, split=False)
    b = _host_work(jobs, caps, costs, split=True)
    assert a == pytest.approx(b, rel=1e-7, abs=_solver_slack(jobs))


@settings(max_examples=examples(60), deadline=None)
@given(data=st.data())
def test_host_step_deadlines_place_work_as_a_split_does(data):
    """NOTE: [Host step deadlines]: with exact clipping every host step is released at the tail and
    due before its next prefetch, later stages later; the backlog with `due` reaches exactly what
    splitting each step over its own windows reaches."""
    n = data.draw(st.integers(1, 7))
    count = data.draw(st.integers(1, 6))
    releases = sorted(data.draw(st.lists(st.integers(0, n - 1), min_size=count, max_size=count)))
    dues = sorted(data.draw(st.lists(st.integers(0, n - 1), min_size=count, max_size=count)))
    dues = [max(d, r) for r, d in zip(releases, dues)]
    dues = [max(dues[:i + 1]) for i in range(count)]  # first released, first due
    dues[-1] = n - 1  # the last window clears the backlog
    amounts = data.draw(st.lists(st.floats(0.01, 5.0), min_size=count, max_size=count))
    caps = data.draw(st.lists(st.floats(0.0, 3.0), min_size=n, max_size=n))
    costs = data.draw(st.lists(st.floats(-1.0, 1.0), min_size=n, max_size=n))
    jobs = list(zip(releases, dues, amounts))
    a = _host_work(jobs, caps, costs, split=False, deadlines=True)
    b = _host_work(jobs, caps, costs, split=True)
    assert a == pytest.approx(b, rel=1e-7, abs=_solver_slack(jobs))


def test_host_steps_take_two_columns_per_window():
    """The host steps' placement grows with the windows, not with stages times windows (NOTE: [Host
    step backlog]): the 72B shape's MIP had 3,322 such columns of 4,223."""
    meta, _, batch = random_block_model(ModelSpec(tuple(BlockSpec("mlp", 16) for _ in range(12))))
    stages = analyse(meta, batch, HW)[1]
    m, *_ = _build(stages, HW, int(smallest_budget(stages, HW) * 1.5), minimise_memory=False)
    host = [var for var in m.vars if var.name.startswith(("cpu", "backlog"))]
    assert 0 < len(host) <= 2 * (len(stages) + 1)


def _tiny_mip():
    m = mip.Model(sense=mip.MINIMIZE, solver_name=mip.CBC)
    m.verbose = 0
    x = [m.add_var(var_type=mip.BINARY) for _ in range(4)]
    m += mip.xsum(x) >= 2
    m.objective = mip.minimize(mip.xsum((i + 1) * v for i, v in enumerate(x)))
    return m


@pytest.mark.parametrize("says_presolved", [False, True])
def test_a_search_that_never_returns_is_killed_and_solved_again_without_presolve(monkeypatch, says_presolved):
    """NOTE: [Presolve watchdog] in solver/milp.py: HiGHS's presolve can loop past its time limit.
    Here the first search (with presolve) never returns. Still in presolve, it is killed once
    presolve has had its `PRESOLVE_LIMIT_S`, long before the 60 s time limit; past presolve, at the
    time limit and its grace. Then a second search without presolve answers."""
    import time

    pytest.importorskip("highspy")
    monkeypatch.setattr(milp, "solver_name", lambda: "highs")
    monkeypatch.setattr(milp, "WATCHDOG_GRACE_S", 0.5)
    monkeypatch.setattr(milp, "PRESOLVE_LIMIT_S", 0.5)
    run = milp._highs_run
    tries = []

    def hangs_with_presolve(m, time_limit, gap, start, presolve, presolved=None):
        tries.append(presolve)
        if presolve:
            if says_presolved:
                presolved()
            time.sleep(3600)
        return run(m, time_limit, gap, start, presolve)
    monkeypatch.setattr(milp, "_highs_run", hangs_with_presolve)
    time_limit = 3.0 if says_presolved else 60.0
    began = time.perf_counter()
    r = milp.optimize(_tiny_mip(), time_limit, 1e-4)
    spent = time.perf_counter() - began
    assert (time_limit < spent < time_limit + 20) if says_presolved else spent < 20
    assert r.found and r.solver == "highs" and r.objective == pytest.approx(3.0)
    assert tries == [False]  # the hanging try ran in the killed child, not here


def test_the_search_says_when_its_presolve_has_ended():
    """The child's signal: HiGHS's first MIP interrupt callback, once, on a model it branches on."""
    pytest.importorskip("highspy")
    m = mip.Model(sense=mip.MINIMIZE, solver_name=mip.CBC)
    m.verbose = 0
    x = [m.add_var(var_type=mip.INTEGER, ub=9) for _ in range(12)]
    for k in range(3):
        m += mip.xsum(((7 * i + 3 * k) % 11 + 1) * v for i, v in enumerate(x)) >= 23 + 5 * k
    m.objective = mip.minimize(mip.xsum(((5 * i) % 13 + 2) * v for i, v in enumerate(x)))
    calls = []
    r = milp._highs_run(m, 10.0, 0.0, None, presolve=True, presolved=lambda: calls.append(1))
    assert r.found and calls == [1]


def test_a_refusal_the_least_memory_plan_contradicts_is_not_made(monkeypatch):
    """NOTE: [A refusal the solver contradicts]: a search that wrongly answers "infeasible" at a budget
    the least-memory plan fits gives that plan, not a refusal."""
    stages = CASES[1]
    need = smallest_budget(stages, HW)
    real, calls = milp.optimize, []

    def wrong_first(m, time_limit, gap, start=None):
        calls.append(m)
        if len(calls) <= 2:  # the searches without and with steps in backward
            return milp.Result(milp.INFEASIBLE, (), float("nan"), float("nan"), "highs", 0.0, 0.0)
        return real(m, time_limit, gap, start)
    monkeypatch.setattr(milp, "optimize", wrong_first)
    plan = solve(stages, HW, int(need * 1.5))
    assert plan.peak_bytes + HW.allocator_reserve_bytes <= int(need * 1.5)
    assert plan.solver.status == "fallback" and "least-memory plan" in plan.solver.message
    monkeypatch.setattr(milp, "optimize", real)
    assert solve(stages, HW, int(need * 1.5)).step_s <= plan.step_s * (1 + GAP) + 1e-12


def test_a_refusal_whose_least_memory_plan_is_then_rejected_names_no_smallest_budget(monkeypatch):
    """NOTE: [A refusal the solver contradicts]: the search answers "infeasible", the least-memory plan
    fits the budget, and the step model rejects it: the refusal says the three disagree, and names no
    budget (the 2026-12-04 review's contradiction: "smallest feasible budget" under the one refused)."""
    from lazytrain.errors import InfeasibleBudget
    from lazytrain.solver import solve as solve_module

    stages = CASES[1]
    need = smallest_budget(stages, HW)
    real = milp.optimize

    def infeasible_search(m, time_limit, gap, start=None):
        if m.objective.expr and any(v.name == "peak" for v in m.objective.expr):  # the least-memory solve
            return real(m, time_limit, gap, start)
        return milp.Result(milp.INFEASIBLE, (), float("nan"), float("nan"), "highs", 0.0, 0.0)

    def rejected(*args, **kwargs):
        raise PlanError("the given decisions are not a valid plan (solver: infeasible)")
    monkeypatch.setattr(milp, "optimize", infeasible_search)
    monkeypatch.setattr(solve_module, "evaluate", rejected)
    budget = int(need * 1.5)
    with pytest.raises(InfeasibleBudget) as refused:
        solve(stages, HW, budget)
    text = str(refused.value)
    assert "smallest feasible budget" not in text and "disagree" in text and "not a valid plan" in text
    assert refused.value.smallest_feasible == budget + 1


def _nothing_in_time(monkeypatch):
    """The search for the fastest plan stops at its time limit with nothing, and no heuristic fits;
    the solves after it run as they do."""
    from lazytrain.solver import solve as solve_module

    real, calls = milp.optimize, []

    def timed_out(m, time_limit, gap, start=None):
        calls.append(m)
        if len(calls) > 1:  # the least-memory solve, and `evaluate` of its plan
            return real(m, time_limit, gap, start)
        return milp.Result(milp.NO_SOLUTION, (), float("nan"), float("nan"), "highs", 0.0, 0.0)
    monkeypatch.setattr(milp, "optimize", timed_out)
    monkeypatch.setattr(solve_module, "_warm_start", lambda *args: None)


def test_a_search_that_found_nothing_in_time_refuses_with_the_least_memory(monkeypatch):
    """NOTE: [A search that found nothing in time]: below the least memory a plan needs, the refusal
    names it, as a proven infeasible search's does, not only "raise --time-limit"."""
    from lazytrain.errors import InfeasibleBudget

    stages = CASES[1]
    need = smallest_budget(stages, HW)
    _nothing_in_time(monkeypatch)
    with pytest.raises(InfeasibleBudget) as refused:
        solve(stages, HW, int(need * 0.9))
    assert refused.value.smallest_feasible == need
    assert "smallest feasible budget" in str(refused.value)


def test_a_search_that_found_nothing_in_time_gives_the_least_memory_plan_where_it_fits(monkeypatch):
    stages = CASES[1]
    need = smallest_budget(stages, HW)
    _nothing_in_time(monkeypatch)
    plan = solve(stages, HW, int(need * 1.5))
    assert plan.solver.status == "fallback" and "found none in" in plan.solver.message
    assert plan.peak_bytes + HW.allocator_reserve_bytes <= int(need * 1.5)


def test_a_refusal_below_the_least_memory_plan_stands():
    from lazytrain.errors import InfeasibleBudget

    stages = CASES[1]
    need = smallest_budget(stages, HW)
    with pytest.raises(InfeasibleBudget) as refused:
        solve(stages, HW, int(need * 0.9))
    assert refused.value.smallest_feasible >= need * 0.99


def test_a_refusal_whose_least_memory_solve_ran_out_of_time_does_not_call_its_budget_the_smallest(monkeypatch):
    """NOTE: [A refusal the solver contradicts]: a least-memory solve stopped at its time limit
    found a plan, which is not the least one; the refusal names its budget as one that fits."""
    from lazytrain.errors import InfeasibleBudget

    stages = CASES[1]
    need = smallest_budget(stages, HW)
    real = milp.optimize

    def stopped(m, time_limit, gap, start=None):
        r = real(m, time_limit, gap, start)
        return dataclasses.replace(r, status=milp.FEASIBLE) if r.status == milp.OPTIMAL else r
    monkeypatch.setattr(milp, "optimize", stopped)
    with pytest.raises(InfeasibleBudget) as refused:
        solve(stages, HW, int(need * 0.9))
    assert "smallest feasible budget" not in str(refused.value) and "less may do" in str(refused.value)
    assert refused.value.smallest_feasible >= need * 0.99
