"""Invariants of compiled plans over random models and budgets (Hypothesis).

For random block models (1-5 blocks of random kinds and widths, optionally a tied head and a table
every block reads) and a random budget between the smallest feasible one and four times it:
compile succeeds, the verifier's memory trace and the plan's predicted peak stay within the budget,
and the replay equals eager PyTorch. Any budget below the least any plan needs (at most the
least-memory solve's 1 % gap below the smallest named) raises `InfeasibleBudget`, which names that
smallest budget.
"""

from __future__ import annotations

import re
import subprocess
import sys
import textwrap

import pytest
from hypothesis import HealthCheck, currently_in_test_context, event, given, settings
from hypothesis import strategies as st

from lazytrain.errors import InfeasibleBudget
from lazytrain.passes.verify import verify
from lazytrain.pipeline import compile_model, minimum_budget
from lazytrain.solver.solve import LEAST_GAP
from lazytrain.units import parse_size
from checks import check_replay, replay_equals_eager
from models import BlockSpec, ModelSpec, examples, model_specs, random_block_model

SMALLEST = re.compile(r"smallest feasible budget: (\d+(?:\.\d)? (?:B|KiB|MiB|GiB))")


@settings(max_examples=examples(40), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(spec=model_specs(), above=st.floats(0.0, 3.0), below=st.floats(0.0, 1.0, exclude_max=True))
def test_random_budgets(spec, above, below):
    meta, real, batch = random_block_model(spec)
    smallest = minimum_budget(meta, batch, "cpu")

    # feasible: anywhere from the smallest budget to four times it
    budget = smallest + int(above * smallest)
    c = compile_model(meta, batch, budget, "cpu", time_limit=20)
    assert c.plan.budget == budget
    assert c.plan.peak_bytes <= budget
    trace = verify(c.schedule)
    assert trace == c.memory_trace
    assert max(trace) <= c.plan.peak_bytes <= budget
    if currently_in_test_context():
        event(f"{sum(d.streamed for d in c.plan.decisions)} of {len(c.stages)} stages streamed")
    check_replay(c.source_text, real, batch)

    # infeasible: anything below the least any plan needs, which is at most the least-memory solve's
    # gap below the smallest budget named; within the gap a plan may fit, and then keeps within it
    low = int(below * smallest)
    if low >= (1 - LEAST_GAP) * smallest:
        try:
            assert compile_model(meta, batch, low, "cpu", time_limit=20).plan.peak_bytes <= low
            return
        except InfeasibleBudget:
            pass
    with pytest.raises(InfeasibleBudget) as info:
        compile_model(meta, batch, low, "cpu", time_limit=20)
    assert info.value.smallest_feasible == smallest
    match = SMALLEST.search(str(info.value))
    assert match, str(info.value)
    assert parse_size(match.group(1)) >= smallest  # the printed figure, passed back, is feasible


def test_minimum_budget_is_exact():
    """The smallest budget compiles (and replays like eager); one byte less does not."""
    meta, real, batch = random_block_model(ModelSpec((BlockSpec("mlp", 24), BlockSpec("linear", 16)), table="const"))
    smallest = minimum_budget(meta, batch, "cpu")
    assert replay_equals_eager(meta, real, batch, smallest).plan.peak_bytes == smallest
    with pytest.raises(InfeasibleBudget):
        compile_model(meta, batch, smallest - 1, "cpu")


_DEADLOCK = textwrap.dedent("""
    import gc
    gc.disable()  # collect only where this script says
    import torch
    from lazytrain.pipeline import minimum_budget

    class M(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc = torch.nn.Linear(4, 4)

        def forward(self, x):
            return self.fc(x).square().mean()

    with torch.device("meta"):
        model = M()
    minimum_budget(model, {"x": torch.zeros(2, 4)}, "cpu")  # lazytrain's solver models are garbage now
    from mip import cbc
    with cbc.ffi._lock:  # cffi holds this while it parses a C type string it has not seen before
        gc.collect()  # the garbage collector may run right there
    print("no deadlock")
""")


def test_solver_garbage_cannot_deadlock():
    """A garbage collection while cffi holds its lock must not re-enter cffi (run in a fresh process,
    without conftest's workaround)."""
    try:
        out = subprocess.run([sys.executable, "-c", _DEADLOCK], capture_output=True, text=True, timeout=90)  # a deadlock never ends; a slow machine may take a while
    except subprocess.TimeoutExpired:
        pytest.fail("deadlock: freeing lazytrain's solver models re-entered cffi's lock")
    assert out.returncode == 0 and "no deadlock" in out.stdout, out.stderr[-2000:]
