"""Pass `solve`: choose, per stage, weight streaming, recomputation and output placement with a MIP.

Needs: `Stages` (sizes and times per stage), a `Hardware` profile and a GPU budget in bytes.
Guarantees: a `Plan` whose predicted GPU memory fits the budget in every window, minimising the
predicted step time; or `InfeasibleBudget` carrying the smallest feasible budget (found by a second
solve that minimises peak memory instead).

The model itself (its variables, windows and constraints) is `formulation.py`'s.
"""

from __future__ import annotations

import dataclasses
import time

from lazytrain.errors import InfeasibleBudget, PlanError, one_line
from lazytrain.hardware import Hardware
from lazytrain.ir.placement import Internals, Outputs, Placement, Step, Weights
from lazytrain.ir.plan import Plan, SolverInfo
from lazytrain.ir.stages import Stages
from lazytrain.passes.limits import limits
from lazytrain.solver import milp
from lazytrain.solver.footprint import disk_available
from lazytrain.solver.formulation import SEARCH_BACKWARD_STEPS, _build, _decisions, _plan, _start
from lazytrain.solver.refusal import past_device, state_floor
from lazytrain.solver.shards import sharding
from lazytrain.units import format_size


def heuristics(stages: Stages) -> dict[str, list[Placement]]:
    """Fixed policies, as layer-streaming trainers use: warm starts for CBC and the fallback when
    the solver finds nothing in time."""
    closed = limits(stages)

    def policy(stream: bool, recompute: bool, step: Step = Step.host()) -> list[Placement]:
        """`step`: a streamed stage's (a stage that cannot stream stays resident)."""
        def one(lim) -> Placement:
            internals = Internals.RECOMPUTED if recompute and not lim.recompute else Internals.SAVED
            if not stream or lim.stream:
                return Placement(Weights(), internals, Outputs.KEEP, Step.resident())
            return Placement(Weights(streamed=True), internals, Outputs.KEEP, step)
        return [one(lim) for lim in closed]
    return {
        "stream every block, checkpoint every block": policy(True, True),
        "stream every block, optimizer on the GPU, checkpoint every block": policy(True, True, Step.at_prefetch()),
        "everything resident, checkpoint every block": policy(False, True),
        "everything resident and saved": policy(False, False),
    }


def _warm_start(stages: Stages, hw: Hardware, budget: int) -> tuple[str, Plan] | None:
    """The fastest heuristic plan that fits, or None. (CBC mishandles an infeasible start, so only
    a plan checked to fit is offered.)"""
    fits = []
    for name, decisions in heuristics(stages).items():
        try:
            fits.append((name, evaluate(stages, hw, budget, decisions, status="fallback")))
        except PlanError:
            continue
    return min(fits, key=lambda f: f[1].step_s) if fits else None


# The least-memory solve stops within this relative gap: the budget it names always fits, and the
# least any plan needs is at most that much below it (a random block model on the CPU profile named
# 3956 B, where a plan offloading one more output peaks at 3924, 0.8 % less; tests/test_properties.py)
LEAST_GAP = 1e-2


def smallest_budget(stages: Stages, hw: Hardware, time_limit: float = 30.0) -> int:
    """The least GPU memory any plan needs (a solve that minimises peak memory), within `LEAST_GAP`:
    a plan fits it, and none fits below (1 - LEAST_GAP) of it where the solve finished (stopped at
    its time limit, it names a plan that fits, and no more is known)."""
    return _least_memory(stages, hw, time_limit)[0]


def _least_memory(stages: Stages, hw: Hardware, time_limit: float = 30.0) -> tuple[int, list[Placement], bool]:
    """The least GPU memory any plan needs, the decisions of a plan that needs it, and whether the
    solve proved it least (within its gap) or stopped at its time limit with a plan that fits it."""
    m, v, model, exposed = _build(stages, hw, None, minimise_memory=True, backward_steps=True)
    # Min-max objectives have many near-ties; proving the last 1% can take CBC minutes. The plan
    # found is feasible either way, so the budget it names always works.
    r = milp.optimize(m, time_limit, LEAST_GAP)
    if not r.found:
        n = sharding(stages)  # sharded state: a rank holds 1/N of the masters
        weights = stages.master_bytes * (sum(g.param_numel for g in stages) + stages.shared_numel) // n
        whose = "the model's master weights" if n == 1 else f"a rank's 1/{n} of the model's master weights"
        if weights > hw.host_capacity:
            raise PlanError(
                f"{whose} alone ({format_size(weights)}) exceed the host memory plans may use on hardware "
                f"profile '{hw.name}' ({format_size(hw.host_capacity)}); use a profile of a machine with more host memory")
        raise PlanError(f"no plan fits even with unlimited GPU memory (solver: {r.status}); the host memory plans "
                        f"may use on '{hw.name}' ({format_size(hw.host_capacity)}) is too small for the optimizer "
                        "states and offloaded tensors this model needs")
    need = max(int(round(milp.value(t, r))) for t in model.mem + [model.tail]) + hw.allocator_reserve_bytes
    return need, _decisions(v, len(stages), lambda e: milp.value(e, r)), r.status == milp.OPTIMAL


def _disk_hint(stages: Stages, hw: Hardware, need: int) -> str:
    """Where the disk tier is off and would lower the smallest budget (host memory binds: with
    optimizer states on disk more blocks can stream), by how much (NOTE: [Disk-resident states] in disk_model.py)."""
    if stages.disk or sharding(stages) > 1 or not disk_available(hw):
        return ""
    try:
        with_disk = smallest_budget(dataclasses.replace(stages, disk=True), hw, time_limit=10.0)
    except PlanError:
        return ""
    if with_disk >= need:
        return ""
    return (f", or let the plan keep optimizer states and stage outputs on disk (--disk), where the smallest feasible budget is "
            f"{format_size(with_disk, round_up=True)}")


# NOTE: [A refusal the solver contradicts] A refusal names the least memory any plan needs, from a
# second solve (`_least_memory`). Should that plan fit the budget the search called infeasible, the
# two solves contradict each other and the refusal would be false: a refused compile must rest on
# a proof. So where the least-memory plan fits, it is the plan (its time priced by `evaluate`),
# with a message saying why. This catches the contradiction only where it shows: on the 2-core
# machine (2026-12-04, 085b863) a 14B at 24 GiB, compiled beside another compile, was refused once
# with "smallest feasible budget: 77.8 GiB", a plan this check would not have questioned; alone it
# plans 21.9 GiB, and the refusal did not come again in three tries. A least-memory solve stopped
# at its time limit names the peak of a plan it found, not the least any plan needs (whether the
# 77.8 GiB came so is not known): such a refusal says that a plan fits that budget, and no more.
# Where the least-memory plan fits the budget but the step model then rejects it (`evaluate`), all
# three disagree: the refusal says so and names no budget as the least, carrying the budget plus a
# byte (the least any plan could need, for the caller that compares refusals).
GAP = 1e-2  # the relative gap a solve stops at; reported in the plan (NOTE: [HiGHS beside CBC] in milp.py)


def solve(stages: Stages, hw: Hardware, budget: int, time_limit: float = 60.0, gap: float = GAP) -> Plan:
    start = time.perf_counter()
    # CBC searches better from a start; HiGHS finds one as fast as the heuristics are evaluated,
    # so they are evaluated only if it finds none (the fallback below).
    warm = _warm_start(stages, hw, budget) if milp.solver_name() == "cbc" else None
    t_warm = time.perf_counter()
    m, v, model, exposed = _build(stages, hw, budget, minimise_memory=False)
    t_build = time.perf_counter()
    r = milp.optimize(m, max(1.0, time_limit - (t_build - start)), gap,
                      _start(v, warm[1].decisions) if warm is not None else None)
    if r.status == milp.INFEASIBLE and not SEARCH_BACKWARD_STEPS:  # NOTE: [Backward steps where nothing else fits]
        m, v, model, exposed = _build(stages, hw, budget, minimise_memory=False, backward_steps=True)
        r = milp.optimize(m, max(1.0, time_limit - (time.perf_counter() - start)), gap)
    took = time.perf_counter() - start
    times = ((("heuristics", t_warm - start),) if warm else ()) + (
        ("model", t_build - t_warm), ("handover", r.setup_s), ("search", r.search_s))
    if r.presolve_s:
        times += (("of which presolve", r.presolve_s),)
    if r.found:
        info = SolverInfo(r.status, r.gap, r.objective * model.unit_s, r.bound * model.unit_s, took,
                          solver=r.solver, times=times)
        plan = _plan(stages, hw, budget, v, model, exposed, r, info)
        extract = time.perf_counter() - start - took
        return dataclasses.replace(plan, solver=dataclasses.replace(
            info, seconds=took + extract, times=times + (("plan", extract),)))
    if r.status == milp.INFEASIBLE:
        return _least_or_refuse(stages, hw, budget, start, "the search found none")
    # Time-out without a solution: use the best heuristic policy that fits.
    warm = warm or _warm_start(stages, hw, budget)
    if warm is None:  # NOTE: [A search that found nothing in time]
        return _least_or_refuse(stages, hw, budget, start, f"the search found none in {time_limit:.0f}s")
    name, plan = warm
    msg = f"the solver found no plan in {time_limit:.0f}s; fell back to the heuristic '{name}'"
    return dataclasses.replace(plan, solver=dataclasses.replace(plan.solver, message=msg, seconds=took))


# NOTE: [A search that found nothing in time] A search stopped at its time limit without a plan,
# where no heuristic policy fits either, is answered like one that proved none fits: by the
# least-memory solve. Its plan is the plan where it fits; otherwise the refusal names the least
# memory a plan needs, and the GPU that would hold it, instead of only "raise --time-limit". The 7B
# at 1 x 1,048,576 with --disk on the whole H200 (137.8 GiB) came so once attention's forward no
# longer counted its backward's accumulator (2026-12-05): the search had proved no plan fits in 24 s
# at 149.6 GiB of least memory, and at 146.6 it ran out its 60 s.
def _least_or_refuse(stages: Stages, hw: Hardware, budget: int, start: float, searched: str) -> Plan:
    """The least-memory plan where it fits `budget` (NOTE: [A refusal the solver contradicts]),
    else `InfeasibleBudget` naming the least memory a plan needs; `searched`: what the search for
    the fastest plan found, for the messages."""
    need, least, proven = _least_memory(stages, hw)
    if need <= budget:
        try:
            plan = evaluate(stages, hw, budget, least, status="fallback", message=(
                f"{searched}, but the least-memory plan fits: it is this plan"))
            return dataclasses.replace(plan, solver=dataclasses.replace(plan.solver, seconds=time.perf_counter() - start))
        except PlanError as rejected:
            # the two searches and the step model disagree: no budget the refusal could name is proven
            raise InfeasibleBudget(
                f"no plan fits a GPU budget of {format_size(budget)}: {searched}, and the plan the least-memory "
                f"search found within it ({format_size(need, round_up=True)}) was then rejected ({one_line(rejected)}). "
                "The solvers disagree on this model; raise --time-limit, or --budget", budget + 1) from None
    have, want = format_size(budget), format_size(need, round_up=True)
    if have == want:  # one decimal cannot tell them apart: give bytes too
        have, want = f"{have} ({budget} bytes)", f"{want} ({need} bytes)"
    # NOTE: [A refusal the solver contradicts]: a least-memory solve stopped at its time limit
    # names a budget a plan fits, not the least one
    smallest = f"smallest feasible budget: {want}" if proven else (
        f"a plan fits {want}, and less may do (the search for the least memory a plan needs stopped at its "
        "time limit)")
    raise InfeasibleBudget(
        f"no plan fits a GPU budget of {have}; {smallest}. "
        + (past_device(stages, hw, need, proven) or f"Raise --budget, or shrink the batch{_disk_hint(stages, hw, need)}"),
        need, any_tiles=state_floor(stages, hw) > budget,
    )


def evaluate(stages: Stages, hw: Hardware, budget: int, decisions: list[Placement], *,
             status: str = "fixed", message: str = "") -> Plan:
    """The plan for given decisions: transfer placement solved, memory and time predicted. Raises
    `PlanError` if the decisions break a rule (e.g. dropping outputs a saved stage needs) or the budget."""
    start = time.perf_counter()
    m, v, model, exposed = _build(stages, hw, budget, minimise_memory=False, fixed=decisions)
    r = milp.optimize(m, 60.0, 1e-4)
    if not r.found:
        raise PlanError(f"the given decisions are not a valid plan within {format_size(budget)} (solver: {r.status})")
    objective = r.objective * model.unit_s
    info = SolverInfo(status, 0.0, objective, objective, time.perf_counter() - start, message, solver=r.solver)
    return _plan(stages, hw, budget, v, model, exposed, r, info)
