"""The MIP back end of pass `solve`: python-mip builds the model, HiGHS or CBC searches it.

python-mip is the modelling layer (variables, linear expressions, constraints). `optimize` hands
the built model to HiGHS (the `highspy` package) when it is installed, else to python-mip's own
CBC, and returns the values of every variable by index, so callers read results through `value`
alone, whichever solver ran.

NOTE: [HiGHS beside CBC]
On the 7B bench at 24 GiB, CBC ran into a 60 s limit with a 0.65% gap; HiGHS proved a 1% gap in
about a second of CPU (its root cuts and sub-MIP heuristics close what CBC's branching does not).
HiGHS is read from python-mip's CBC model as a sparse matrix (python-mip 2.0's own HiGHS
interface needs C symbols newer `highspy` wheels no longer export). `LAZYTRAIN_SOLVER=cbc`
forces CBC.

NOTE: [Branching on pseudo-costs]
HiGHS strong-branches (solves both children's LPs for candidate variables) until a variable's
pseudo-cost has `mip_pscost_minreliable` observations, 8 by default. The step MIP's many identical
blocks give near-equal candidates, and on the 72B shape at the full device those strong-branching
LPs were most of the search after the root (25,748 of 38,370 LP iterations): with 0 HiGHS branches on
pseudo-costs from the start and proves the same 1% gap on the same plan in about half the time
(seeds 0-3: 10.2-15.4 s -> 5.3-8.1 s on the 2-core machine; 72B at 80 GiB 20.8 s -> 12.5 s). Cases
the root closes (7B, 72B at 24 and 48 GiB) do not branch and are unchanged.

NOTE: [No RINS]
HiGHS's sub-MIP heuristics, RINS among them (a sub-MIP over the variables where the LP and the
incumbent agree), took 3.8 s of the 72B shape's 8.7 s search at the full device, in seven sub-MIPs,
to improve an incumbent the tree then had to prove anyway. With RINS off the same cases prove the same 1%
gap sooner with plans of the same value (2-core machine, 2026-12-01, one solve each, 8-bit states,
bf16 masters): 72B shape at the full device 8.4 -> 5.9 s, at 80 GiB 24.9 -> 19.2 s, at 48 GiB
7.6 -> 5.2 s; the 7B at 24 and 40 GiB 0.42 and 0.55 s either way.
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass

import mip

OPTIMAL, FEASIBLE, INFEASIBLE, NO_SOLUTION = "optimal", "feasible", "infeasible", "no solution"


@dataclass(frozen=True)
class Result:
    status: str  # OPTIMAL, FEASIBLE (stopped early with a solution), INFEASIBLE, NO_SOLUTION
    values: tuple[float, ...]  # per variable index; empty without a solution
    objective: float
    bound: float
    solver: str  # "highs" or "cbc"
    setup_s: float  # handing the model over
    search_s: float
    presolve_s: float = 0.0  # of `search_s`, HiGHS's presolve (NOTE: [Presolve watchdog])

    @property
    def found(self) -> bool:
        return self.status in (OPTIMAL, FEASIBLE)

    @property
    def gap(self) -> float:
        return abs(self.objective - self.bound) / max(abs(self.objective), 1e-12)


def value(expr, result: Result) -> float:
    """The value of a variable, a linear expression or a constant in `result`."""
    if isinstance(expr, mip.Var):
        return result.values[expr.idx]
    if isinstance(expr, mip.LinExpr):
        return expr.const + sum(c * result.values[v.idx] for v, c in expr.expr.items())
    return float(expr)


def solver_name() -> str:
    """"highs" where `highspy` imports (and `LAZYTRAIN_SOLVER` does not say "cbc"), else "cbc"."""
    if os.environ.get("LAZYTRAIN_SOLVER", "").lower() == "cbc":
        return "cbc"
    try:
        import highspy  # noqa: F401
    except ImportError:
        return "cbc"
    return "highs"


def optimize(m: mip.Model, time_limit: float, gap: float, start: dict[mip.Var, float] | None = None) -> Result:
    """Minimise `m` until the relative gap is at most `gap` or `time_limit` seconds pass. `start`:
    values for some variables (a solution the search may begin from)."""
    if solver_name() == "highs":
        r = _highs(m, time_limit, gap, start)
        if r.found:
            return r
        # NOTE: [Second opinion] HiGHS has answered "no solution" for a plan CBC solves (a random
        # tiny block model with fixed decisions, tests/test_forced_plans.py): a refusal must not
        # rest on one solver's word, so CBC gets the rest of the time before a plan is refused.
        return _cbc(m, max(1.0, time_limit - r.setup_s - r.search_s), gap, start)
    return _cbc(m, time_limit, gap, start)


def _cbc(m, time_limit, gap, start) -> Result:
    t0 = time.perf_counter()
    m.max_mip_gap = gap
    if start:
        m.start = list(start.items())
    t1 = time.perf_counter()
    status = m.optimize(max_seconds=time_limit)
    t2 = time.perf_counter()
    S = mip.OptimizationStatus
    if status in (S.OPTIMAL, S.FEASIBLE):
        return Result(OPTIMAL if status is S.OPTIMAL else FEASIBLE, tuple(v.x for v in m.vars), m.objective_value,
                      m.objective_bound, "cbc", t1 - t0, t2 - t1)
    return Result(INFEASIBLE if status is S.INFEASIBLE else NO_SOLUTION, (), float("nan"), float("nan"), "cbc",
                  t1 - t0, t2 - t1)


# NOTE: [Presolve watchdog] HiGHS's MIP presolve can loop without end and does not look at its time
# limit there (`HPresolve::strengthenInequalities`: the 72B shape at 24 GiB, 2026-12-01, after the
# saved-bytes rules changed its coefficients; a known class of HiGHS bugs). So the search runs in a
# forked child, which says when presolve has ended (HiGHS's first MIP interrupt callback comes from
# the search after it). A child that has not said so within `PRESOLVE_LIMIT_S`, or not answered
# within the time limit (plus a grace), is killed, and HiGHS runs again here without presolve, which
# that model solved in 0.4 s. Not always so: without presolve the 72B shape at the full device took
# 44 s against 13-17 s with it, so presolve stays the first try. Presolve took 0.44 s on the 72B
# shape at the full device and 0.07-0.11 s on the 7B at 24 GiB (2-core machine, 2026-12-01), so
# `PRESOLVE_LIMIT_S` leaves it 7x; waiting the whole time limit for a hung one cost that compile
# 65 s, the 10 s limit first tried 10.4 s. A fork keeps the plan deterministic: the same solver and
# options whenever the child answers in time.
WATCHDOG_GRACE_S = 5.0
PRESOLVE_LIMIT_S = 3.0
_PRESOLVED = "presolved"


def _highs(m, time_limit, gap, start) -> Result:
    import multiprocessing

    if os.name != "posix" or os.environ.get("LAZYTRAIN_NO_WATCHDOG"):
        return _highs_run(m, time_limit, gap, start, presolve=True)
    ctx = multiprocessing.get_context("fork")
    recv, send = ctx.Pipe(duplex=False)

    def child():
        try:
            send.send(_highs_run(m, time_limit, gap, start, presolve=True, presolved=lambda: send.send(_PRESOLVED)))
        finally:
            send.close()
    t0 = time.perf_counter()
    proc = ctx.Process(target=child, daemon=True)
    proc.start()
    send.close()
    try:
        if recv.poll(min(PRESOLVE_LIMIT_S, time_limit + WATCHDOG_GRACE_S)):
            answer = recv.recv()
            if answer != _PRESOLVED:
                return answer
            if recv.poll(max(0.0, time_limit + WATCHDOG_GRACE_S - (time.perf_counter() - t0))):
                return recv.recv()
    except EOFError:  # the child died without an answer
        pass
    finally:
        if proc.is_alive():
            proc.kill()
        proc.join()
        recv.close()
    spent = time.perf_counter() - t0
    r = _highs_run(m, time_limit, gap, start, presolve=False)
    return dataclasses.replace(r, search_s=r.search_s + spent)


def _highs_run(m, time_limit, gap, start, presolve: bool, presolved=None) -> Result:
    """HiGHS on `m`; `presolved()` is called once, when the search after presolve begins."""
    import highspy
    import numpy as np

    t0 = time.perf_counter()
    h = getattr(highspy, "_Highs", highspy.Highs)()  # the bare solver: the `Highs` wrapper prints a banner to stdout
    h.setOptionValue("output_flag", False)
    if not presolve:
        h.setOptionValue("presolve", "off")
    h.setOptionValue("threads", 1)
    h.setOptionValue("random_seed", 0)
    h.setOptionValue("time_limit", float(time_limit))
    h.setOptionValue("mip_rel_gap", float(gap))
    h.setOptionValue("mip_pscost_minreliable", 0)  # NOTE: [Branching on pseudo-costs]
    h.setOptionValue("mip_heuristic_run_rins", False)  # NOTE: [No RINS]
    variables = m.vars
    n = len(variables)
    lp = highspy.HighsLp()
    lp.num_col_ = n
    cost = np.zeros(n)
    for v, c in m.objective.expr.items():
        cost[v.idx] += c
    lp.col_cost_ = cost
    lp.offset_ = m.objective.const
    lp.col_lower_ = np.array([v.lb for v in variables], dtype=float)
    lp.col_upper_ = np.array([v.ub for v in variables], dtype=float)
    integer = (mip.BINARY, mip.INTEGER)
    lp.integrality_ = [highspy.HighsVarType.kInteger if v.var_type in integer else highspy.HighsVarType.kContinuous
                       for v in variables]
    starts, index, coef, lower, upper = [0], [], [], [], []
    for c in m.constrs:
        e = c.expr
        for v, a in e.expr.items():
            index.append(v.idx)
            coef.append(a)
        starts.append(len(index))
        rhs = -e.const
        lower.append(rhs if e.sense in (">", "=") else -highspy.kHighsInf)
        upper.append(rhs if e.sense in ("<", "=") else highspy.kHighsInf)
    lp.num_row_ = len(lower)
    lp.row_lower_ = np.array(lower, dtype=float)
    lp.row_upper_ = np.array(upper, dtype=float)
    a = lp.a_matrix_
    a.format_ = highspy.MatrixFormat.kRowwise
    a.num_col_, a.num_row_ = n, len(lower)
    a.start_ = np.array(starts, dtype=np.int32)
    a.index_ = np.array(index, dtype=np.int32)
    a.value_ = np.array(coef, dtype=float)
    h.passModel(lp)
    if start:
        sol = highspy.HighsSolution()
        x = np.zeros(n)
        for v, val in start.items():
            x[v.idx] = val
        sol.col_value = x
        sol.value_valid = True
        h.setSolution(sol)
    ended = []

    def interrupt(*_):
        if not ended:
            ended.append(time.perf_counter())
            h.stopCallback(highspy.cb.HighsCallbackType.kCallbackMipInterrupt)
            if presolved is not None:
                presolved()
    h.setCallback(interrupt, None)
    h.startCallback(highspy.cb.HighsCallbackType.kCallbackMipInterrupt)
    t1 = time.perf_counter()
    h.run()
    t2 = time.perf_counter()
    pre = (ended[0] if ended else t2) - t1
    status = h.getModelStatus()
    info = h.getInfo()
    M = highspy.HighsModelStatus
    if status in (M.kInfeasible, M.kUnboundedOrInfeasible):
        return Result(INFEASIBLE, (), float("nan"), float("nan"), "highs", t1 - t0, t2 - t1, pre)
    if info.primal_solution_status != 2:  # kSolutionStatusFeasible
        return Result(NO_SOLUTION, (), float("nan"), float("nan"), "highs", t1 - t0, t2 - t1, pre)
    values = tuple(h.getSolution().col_value)
    return Result(OPTIMAL if status == M.kOptimal else FEASIBLE, values, info.objective_function_value,
                  info.mip_dual_bound, "highs", t1 - t0, t2 - t1, pre)
