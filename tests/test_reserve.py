"""A plan leaves the caching allocator room under its budget for the step's largest allocation
(NOTE: [Room for the largest block] in lazytrain/solver/reserve.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from lazytrain import hardware
from lazytrain.ir.graph import TensorSpec
from lazytrain.pipeline import compile_model
from lazytrain.solver.reserve import LARGEST_MARGIN, largest_allocation
from models import model_pair
from test_packing_grads import VOCAB, build

HIDDEN = 32  # build("qwen2")'s hidden size


@pytest.fixture(scope="module")
def qwen():
    meta, _ = model_pair(lambda: build("qwen2"))
    ids = torch.randint(0, VOCAB, (2, 32), generator=torch.Generator().manual_seed(0))
    return meta, {"input_ids": ids, "labels": ids.clone()}


def _tensors(value):
    return [value] if isinstance(value, TensorSpec) else [v for v in value or () if isinstance(v, TensorSpec)]


def test_a_profile_with_a_reserve_gets_room_for_the_largest_allocation(qwen):
    meta, batch = qwen
    hw = replace(hardware.load("cpu"), allocator_reserve_bytes=4096)  # less than any tensor of the step
    c = compile_model(meta, batch, "max", hw, time_limit=20, loss_chunk_bytes=0)
    largest = largest_allocation(c.graph, c.stages)
    # unchunked, the largest is the largest value any operator makes, or an fp32 master's gradient
    values = max(t.nbytes for n in c.graph for t in _tensors(n.value))
    assert largest == max(values, 4 * VOCAB * HIDDEN) and largest >= 2 * 32 * VOCAB * 4  # the fp32 logits
    assert c.schedule.reserve == largest + LARGEST_MARGIN
    assert c.plan.peak_bytes + c.schedule.reserve <= c.plan.budget


def test_a_reserve_larger_than_the_need_is_kept_and_none_is_made_where_the_profile_has_none(qwen):
    meta, batch = qwen
    big = replace(hardware.load("cpu"), allocator_reserve_bytes=LARGEST_MARGIN + (1 << 30))
    assert compile_model(meta, batch, "max", big, time_limit=20).schedule.reserve == big.allocator_reserve_bytes
    assert compile_model(meta, batch, "max", "cpu", time_limit=20).schedule.reserve == 0


def test_a_chunked_stage_counts_one_chunk_of_its_values(qwen):
    meta, batch = qwen
    whole = compile_model(meta, batch, "max", "cpu", time_limit=20, loss_chunk_bytes=0)
    parts = compile_model(meta, batch, "max", "cpu", time_limit=20, loss_chunk_bytes=4096)
    last = parts.stages[len(parts.stages) - 1]
    assert last.chunks > 1
    logits = max(t.nbytes for n in last.nodes if n not in last.whole for t in _tensors(parts.graph[n].value))
    assert largest_allocation(whole.graph, whole.stages) >= logits
    assert largest_allocation(parts.graph, parts.stages) < logits


def test_compile_says_when_the_plan_leaves_the_allocator_more_than_the_profile(tmp_path, capsys):
    import json

    from lazytrain.cli import main

    profile = json.loads(hardware.BUILTIN["cpu"].read_text())
    (tmp_path / "hw.json").write_text(json.dumps(dict(profile, allocator_reserve_bytes=4096)))
    assert main(["compile", "lazytrain/examples/tiny_gpt.py", "-o", str(tmp_path / "s.py"),
                 "--hardware", str(tmp_path / "hw.json")]) == 0
    out = capsys.readouterr().out
    assert "the plan leaves the GPU's caching allocator 512.0" in out and "more than the profile's 4.0 KiB" in out, out
    assert main(["compile", "lazytrain/examples/tiny_gpt.py", "-o", str(tmp_path / "s.py"), "--hardware", "cpu"]) == 0
    assert "caching allocator" not in capsys.readouterr().out


def test_a_refusal_names_inductors_host_share_only_where_the_plan_left_it(qwen):
    from lazytrain.errors import InfeasibleBudget

    meta, batch = qwen
    hw = replace(hardware.load("cpu"), allocator_reserve_bytes=4096)  # raised by the rule; no fused bodies on a CPU
    with pytest.raises(InfeasibleBudget) as refused:
        compile_model(meta, batch, 400 << 20, hw, time_limit=20)  # less than the reserve the rule leaves
    assert "no plan fits" in str(refused.value) and "Inductor" not in str(refused.value)
