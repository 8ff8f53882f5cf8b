"""The plan cache returns a plan only for the inputs it was solved for."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import textwrap

import pytest

from lazytrain import hardware
from lazytrain.pipeline import analyse
from lazytrain.solver import plancache
from lazytrain.solver.solve import smallest_budget, solve
from models import tiny_gpt_pair

HW = hardware.load("cpu")


@pytest.fixture(scope="module")
def stages():
    meta, _, batch = tiny_gpt_pair()
    return analyse(meta, batch, HW)[1]


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    monkeypatch.setenv("LAZYTRAIN_NO_CACHE", "0")
    calls = []

    def counting(*args, **kwargs):
        calls.append(args)
        return solve(*args, **kwargs)
    monkeypatch.setattr(plancache, "solve", counting)
    return tmp_path / "lazytrain" / "plans", calls


def test_key_separates_every_input(stages):
    budget = smallest_budget(stages, HW) * 2
    base = plancache.key(stages, HW, budget)
    assert base == plancache.key(stages, HW, budget)
    g = stages[1]
    others = [
        plancache.key(stages, HW, budget + 1),
        plancache.key(stages, HW, budget, gap=1e-3),
        plancache.key(stages, dataclasses.replace(HW, h2d_bandwidth=HW.h2d_bandwidth * 2), budget),
        plancache.key(stages, dataclasses.replace(HW, host_memory_bytes=HW.host_memory_bytes - 1), budget),
        plancache.key(stages, dataclasses.replace(HW, gpu_adamw8bit_params_per_s=HW.gpu_adamw8bit_params_per_s * 2), budget),
        plancache.key(dataclasses.replace(stages, master_bytes=2), HW, budget),
        plancache.key(dataclasses.replace(stages, state_bytes=2.03125), HW, budget),
        plancache.key(dataclasses.replace(stages, stages=stages.stages[:1] + (dataclasses.replace(g, fwd_s=g.fwd_s * (1 + 1e-15)),)
                                          + stages.stages[2:]), HW, budget),
        plancache.key(dataclasses.replace(stages, stages=stages.stages[:1] + (dataclasses.replace(g, out_bytes=g.out_bytes + 1),)
                                          + stages.stages[2:]), HW, budget),
    ]
    assert len(set(others + [base])) == len(others) + 1


def test_key_is_the_same_in_another_process(stages):
    """Sets (requires_grad) are written sorted: string hashing differs between processes."""
    script = textwrap.dedent("""
        from lazytrain import hardware
        from lazytrain.solver import plancache
        from lazytrain.pipeline import analyse
        from models import tiny_gpt_pair
        hw = hardware.load("cpu")
        meta, _, batch = tiny_gpt_pair()
        print(plancache.key(analyse(meta, batch, hw)[1], hw, 12345))
    """)
    tests = os.path.dirname(__file__)
    keys = {subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, cwd=tests,
                           env=dict(os.environ, PYTHONHASHSEED=seed)).stdout.strip() for seed in ("1", "2")}
    assert keys == {plancache.key(stages, HW, 12345)}


def test_second_solve_comes_from_the_cache(stages, cache):
    where, calls = cache
    budget = smallest_budget(stages, HW) * 2
    first = plancache.cached_solve(stages, HW, budget)
    assert len(calls) == 1 and len(list(where.glob("*.json"))) == 1
    again = plancache.cached_solve(stages, HW, budget)
    assert len(calls) == 1
    assert again.solver.times[0][0] == "plan cache"
    assert dataclasses.replace(again, solver=first.solver) == first
    plancache.cached_solve(stages, HW, budget - 1)  # another budget: solved again, stored apart
    plancache.cached_solve(stages, dataclasses.replace(HW, d2h_bandwidth=HW.d2h_bandwidth / 2), budget)
    assert len(calls) == 3 and len(list(where.glob("*.json"))) == 3


def test_a_file_for_other_inputs_is_not_used(stages, cache):
    where, calls = cache
    budget = smallest_budget(stages, HW) * 2
    plancache.cached_solve(stages, HW, budget)
    (path,) = where.glob("*.json")
    other = plancache.key(stages, HW, budget + 1)
    path.rename(where / f"{other}.json")  # the file names another key than the one inside it
    plancache.cached_solve(stages, HW, budget + 1)
    assert len(calls) == 2
    (where / f"{other}.json").write_text("{not json")
    plancache.cached_solve(stages, HW, budget + 1)  # a corrupt file: solved again, no error
    assert len(calls) == 3
    assert json.loads((where / f"{other}.json").read_text())["key"] == other


def test_an_entry_naming_no_placement_is_a_miss(stages, cache):
    """An entry written when decisions were flags (a dict each), or one whose text names no valid
    placement, is solved again and overwritten, never an error."""
    where, calls = cache
    budget = smallest_budget(stages, HW) * 2
    plancache.cached_solve(stages, HW, budget)
    (path,) = where.glob("*.json")
    data = json.loads(path.read_text())
    assert all(d.startswith("Placement(") for d in data["plan"]["decisions"])
    flags = {"stream": False, "recompute": False, "outputs": "keep", "gpu_step": False, "lookahead": 1, "disk": False}
    refused = "Placement(Weights(streamed=True), Internals.SAVED, Outputs.KEEP, Step.resident())"
    for n, old in enumerate((flags, refused, "__import__('os')", "Placement(Nowhere())"), start=2):
        data["plan"]["decisions"] = [old] * len(stages)
        path.write_text(json.dumps(data))
        plancache.cached_solve(stages, HW, budget)
        assert len(calls) == n
        assert json.loads(path.read_text())["plan"]["decisions"][0].startswith("Placement(Weights(")


def test_no_cache_writes_nothing(stages, cache, monkeypatch):
    where, calls = cache
    monkeypatch.setenv("LAZYTRAIN_NO_CACHE", "1")
    budget = smallest_budget(stages, HW) * 2
    plancache.cached_solve(stages, HW, budget)
    plancache.cached_solve(stages, HW, budget)
    assert len(calls) == 2 and not where.exists()


def test_unfinished_plans_are_not_stored(stages, cache, monkeypatch):
    where, calls = cache
    budget = smallest_budget(stages, HW) * 2
    monkeypatch.setattr(plancache, "solve", lambda *a, **k: dataclasses.replace(
        solve(*a, **k), solver=dataclasses.replace(solve(*a, **k).solver, status="feasible")))
    plancache.cached_solve(stages, HW, budget)
    assert not where.exists() or not list(where.glob("*.json"))


def test_key_follows_the_step_models_code(stages, monkeypatch):
    """Plans cached by other code may count memory another way: the step model's code is in the key."""
    budget = smallest_budget(stages, HW) * 2
    base = plancache.key(stages, HW, budget)
    assert plancache.code_digest() == plancache.code_digest() and len(plancache.code_digest()) == 64
    monkeypatch.setattr(plancache, "_DIGEST", ["0" * 64])
    assert plancache.key(stages, HW, budget) != base
