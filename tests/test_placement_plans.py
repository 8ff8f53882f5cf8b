"""The solver's binaries and the plan's placements name the same thing: `_decisions` reads a
placement from each stage's binaries, `_start` writes them back, exactly, for every placement that
constructs and for the plans the solver finds; and a solved plan, evaluated again from its
placements, is the same plan."""

from __future__ import annotations

import dataclasses
import itertools

import pytest
import torch

from lazytrain import hardware
from lazytrain.ir.placement import KINDS, Internals, Outputs, Placement, PlacementError, Step, Tier, Weights
from lazytrain.pipeline import analyse
from lazytrain.solver import milp
from lazytrain.solver.formulation import KEYS, _binaries, _build, _decisions, _placement, _start
from lazytrain.solver.solve import GAP, evaluate, smallest_budget, solve
from models import disk_gpt, tiny_gpt_pair
from plans import decisions

HW = hardware.load("cpu")
# steps beside backward need a measured pace (the cpu profile has none), so resident stages may free their gradients
PACED = dataclasses.replace(HW, gpu_step_lost=0.25, gpu_step_pace=0.35, gpu_adamw_params_per_s=1e15)


def _every_placement():
    weights = [Weights(streamed, lookahead, cast) for streamed in (False, True) for lookahead in (1, 2) for cast in (False, True)
               if (streamed or lookahead == 1) and not (streamed and cast)]
    steps = [Step(*key, frees) for key in KINDS for frees in (False, True) if not frees or KINDS[key] == "resident"]
    for w, i, o, s in itertools.product(weights, Internals, Outputs, steps):
        try:
            yield Placement(w, i, o, s)
        except PlacementError:
            continue


def test_every_placement_is_its_binaries():
    placements = list(_every_placement())
    assert {p.kind for p in placements} == set(KINDS.values())
    for p in placements:
        on = _binaries(p)
        assert set(on) == set(KEYS)
        assert _placement(on) == p, p


@pytest.fixture(scope="module")
def gpt():
    meta, _, batch = tiny_gpt_pair()
    return meta, batch, analyse(meta, batch, HW)[1]


def _host_of(stages, hw, spec) -> hardware.Hardware:
    """`hw` with just the host memory the plan `spec` needs: where the host binds."""
    return dataclasses.replace(hw, host_memory_bytes=evaluate(stages, hw, 1 << 40, decisions(spec)).host_bytes)


@pytest.fixture(scope="module")
def cases(gpt):
    """name -> (stages, hardware, budget, _build's options): small models whose plans take resident,
    host-stepped, GPU-stepped, disk-state, offloading, cast and gradient-freeing placements."""
    meta, batch, stages = gpt
    least = smallest_budget(stages, HW)
    slow = dataclasses.replace(HW, cpu_adamw_params_per_s=1e3)  # host steps cost: streamed stages step on the GPU
    _, disk, _, _ = disk_gpt(HW, "32bit", "off", 6)
    tight = _host_of(disk, HW, ["-rk", "GRk"] + ["BRk"] * 5 + ["-rk"])
    _, mixed = analyse(meta.to(torch.bfloat16), batch, PACED)
    mixed = dataclasses.replace(mixed, clipping="off")
    small = _host_of(mixed, PACED, ["-Rk"] * (len(mixed) - 1) + ["-rk"])
    return {
        "smallest": (stages, HW, least, {}),
        "roomier": (stages, HW, int(least * 1.3), {}),
        "roomy": (stages, HW, least * 4, {}),
        "slow host steps": (stages, slow, smallest_budget(stages, slow) * 2, {}),
        "states on disk": (disk, tight, smallest_budget(disk, tight), {"backward_steps": True}),
        "cast and freed": (mixed, small, smallest_budget(mixed, small), {}),
    }


def _features(p: Placement) -> set[str]:
    return {p.kind} | {name for name, on in (
        ("cast", p.weights.cast_on_use), ("freed", p.step.frees_grads), ("ahead", p.weights.lookahead == 2),
        ("states on disk", p.step.states is Tier.DISK), ("master on disk", p.step.master is Tier.DISK),
        ("offload", p.outputs is Outputs.OFFLOAD), ("drop", p.outputs is Outputs.DROP),
        ("outputs on disk", p.outputs is Outputs.DISK)) if on}


# Fixed plans whose placements no small solve takes: steps in backward (states and master on disk
# too), disk-stepped jobs, fetches two windows ahead, dropped outputs and outputs on disk.
FIXED = [
    ("gpt", ["-Rd", "-Rk", "SRk", "ERk", "-rk"]),
    ("disk", ["-rk", "GRk"] + ["BRk", "KRk", "XRk", "DRk", "SRk"] + ["-rk"]),
    ("disk", ["-Rf", "-Rf", "-Rk", "-Ro", "-Rk", "KRk", "-Rk", "-rk"]),
    ("masters", ["-rk", "GRk"] + ["MRk", "KRk", "MRk", "BRk", "MRk"] + ["-rk"]),
]


def _solved_binaries(stages, hw, budget, **options):
    """The placements of the solve's plan, and each binary's value in it."""
    m, v, _, _ = _build(stages, hw, budget, minimise_memory=False, **options)
    r = milp.optimize(m, 60.0, GAP)
    assert r.found, r.status

    def val(e) -> float:  # as `formulation._plan` reads them
        return max(0.0, milp.value(e, r))
    values = {x: float(round(val(x))) for key in KEYS for x in v[key]}
    return v, _decisions(v, len(stages), val), values


def test_start_of_solved_placements_is_the_solvers_binaries(cases):
    seen = set()
    for name, (stages, hw, budget, options) in cases.items():
        v, placements, values = _solved_binaries(stages, hw, budget, **options)
        assert _start(v, placements) == values, name
        seen |= set().union(*map(_features, placements))
    assert seen >= {"resident", "host", "prefetch", "cast", "freed", "states on disk", "offload"}


def test_start_of_fixed_placements_is_the_solvers_binaries(gpt):
    models = {"gpt": gpt[2], "disk": disk_gpt(HW, "32bit", "off", 6)[1],
              "masters": disk_gpt(HW, "32bit", "off", 6, compute=torch.bfloat16)[1]}
    seen = set()
    for model, spec in FIXED:
        fixed = decisions(spec)
        v, placements, values = _solved_binaries(models[model], HW, 1 << 40, fixed=fixed)
        assert placements == fixed, spec
        assert _start(v, placements) == values, spec
        seen |= set().union(*map(_features, placements))
    assert seen >= {"backward", "job", "ahead", "drop", "states on disk", "master on disk", "outputs on disk"}


@pytest.mark.parametrize("case", ["smallest", "roomier", "slow host steps", "states on disk", "cast and freed"])
def test_evaluate_of_a_solved_plan_is_that_plan(cases, case):
    stages, hw, budget, _ = cases[case]
    plan = solve(stages, hw, budget)
    again = evaluate(stages, hw, budget, list(plan.decisions))
    assert again.decisions == plan.decisions
    assert (again.peak_bytes, again.host_bytes, again.disk_bytes) == (plan.peak_bytes, plan.host_bytes, plan.disk_bytes)
    assert [w[:2] for w in again.windows] == [w[:2] for w in plan.windows]
    assert again.step_s == pytest.approx(plan.step_s, rel=1e-6)
