"""Steps in backward whose states live on disk (NOTE: [Backward steps from disk] in
solver/disk_model.py): the plan takes their states off the host, puts them on the disk, keeps a
ring of three buffers on the host and counts the disk's seconds; replay equals eager, 8-bit steps
equal the same steps with the states in memory to the bit, AdamW steps equal torch's, and a resumed
run is bit-identical. The solver chooses them only where nothing else fits."""

from __future__ import annotations

import dataclasses
import gc

import pytest

from lazytrain import hardware
from lazytrain.errors import PlanError
from lazytrain.examples import tiny_gpt
from lazytrain.hardware import HOST_RESERVE
from lazytrain.ir.placement import Tier
from lazytrain.runtime.schedule import load_source
from lazytrain.solver.footprint import DISK_RING, disk_gpu_state_bytes, disk_io_s
from lazytrain.solver.solve import evaluate, solve
from lazytrain.summary import summary
from checks import (
    assert_disk_resume_bit_identical, assert_disk_steps_equal_adamw, assert_same_steps, bind_source, offload_files,
    two_on_disk,
)
from models import disk_gpt, unique_name
from plans import decisions, forced

HW = hardware.load("cpu")
HP = dict(lr=1e-3, eps=1e-6)
# 6 blocks, 5 of them stepped in backward (blocks.1 to blocks.5), their states on disk: more than the
# ring's 3 buffers, so reads wait for the writes that free one
IN_MEMORY = ["-rk", "GRk"] + ["BRk"] * 5 + ["-rk"]
SPEC = ["-rk", "GRk"] + ["KRk"] * 5 + ["-rk"]
ON_DISK = range(2, 7)


def _stages(states: str = "32bit", clipping: str = "off", hw=HW, layers: int = 6, dim: int = tiny_gpt.DIM):
    return disk_gpt(hw, states, clipping, layers, dim)


@pytest.fixture(scope="module")
def gpt():
    return _stages()


def test_the_plan_moves_the_states_to_disk_through_a_ring(gpt):
    _, stages, _, _ = gpt
    in_memory = evaluate(stages, HW, 1 << 40, decisions(IN_MEMORY))
    on_disk = evaluate(stages, HW, 1 << 40, decisions(SPEC))
    moved = [disk_gpu_state_bytes(stages[s].param_numel, stages.state_bytes) for s in ON_DISK]
    assert on_disk.disk_bytes == sum(moved)
    assert in_memory.host_bytes - on_disk.host_bytes == sum(moved) - DISK_RING * max(moved)
    assert on_disk.peak_bytes == in_memory.peak_bytes  # the GPU side is a step in backward's
    assert on_disk.disk_s == pytest.approx(sum(disk_io_s(n, HW) for n in moved))
    # the disk's reads and writes are done by B(s+2): with a disk far slower than compute, the step waits
    slow = evaluate(stages, dataclasses.replace(HW, disk_read_bandwidth=1e6, disk_write_bandwidth=1e6), 1 << 40,
                    decisions(SPEC))
    assert slow.disk_s > 10 * on_disk.step_s and slow.step_s >= slow.disk_s
    text = summary(load_source(forced(*gpt[:3], decisions(SPEC), HW).source_text, unique_name()))
    assert "in its backward, states on disk" in text and "; disk " in text


def test_they_need_the_option_the_space_and_no_exact_clipping(gpt):
    _, stages, _, _ = gpt
    with pytest.raises(PlanError):  # compiled without --disk
        evaluate(dataclasses.replace(stages, disk=False), HW, 1 << 40, decisions(SPEC))
    with pytest.raises(PlanError):  # a step in backward cannot know this step's norm
        evaluate(dataclasses.replace(stages, clipping="exact"), HW, 1 << 40, decisions(SPEC))
    need = sum(disk_gpu_state_bytes(stages[s].param_numel, stages.state_bytes) for s in (2, 3))
    with pytest.raises(PlanError):
        evaluate(stages, dataclasses.replace(HW, disk_bytes=need - 1), 1 << 40, decisions(SPEC))


def test_the_solver_takes_them_where_the_host_binds():
    """On the H200 profile, 24 blocks wide enough that streaming pays on the GPU: at the GPU budget of
    a plan with 22 blocks stepped in backward from disk and the host that plan needs, the solver's
    plan fits both, and steps blocks in backward from disk; with the whole host it keeps none there."""
    hw = hardware.load("h200")
    _, stages, _, _ = _stages("8bit", hw=hw, layers=24, dim=256)
    fixed = evaluate(stages, hw, 1 << 40, decisions(["-rk", "GRk"] + ["KRk"] * 22 + ["GRk", "-rk"]))
    budget = fixed.peak_bytes + hw.allocator_reserve_bytes
    roomy = solve(stages, hw, budget, time_limit=30)
    assert not any(d.kind == "backward" and d.step.states is Tier.DISK for d in roomy.decisions)
    small = dataclasses.replace(hw, host_memory_bytes=fixed.host_bytes + HOST_RESERVE)
    plan = solve(stages, small, budget, time_limit=30)
    assert plan.host_bytes <= small.host_capacity and plan.peak_bytes <= budget - hw.allocator_reserve_bytes
    assert sum(d.kind == "backward" and d.step.states is Tier.DISK for d in plan.decisions) >= DISK_RING, plan.decisions


def test_replay_and_adamw_steps_from_disk(gpt, tmp_path):
    graph, stages, batch, real = gpt
    trainer = assert_disk_steps_equal_adamw(forced(graph, stages, batch, decisions(SPEC), HW).source_text, real, batch,
                                            tmp_path, **HP)
    homes = [trainer.store.home[p] for s in ON_DISK for p in trainer.stages[s].params]
    assert all("exp_avg" not in trainer.optimizer.state[p] for p in homes)  # between steps: on disk only
    assert all(trainer.optimizer.state[p]["step"] == 3 for p in homes)
    del trainer
    gc.collect()
    assert offload_files(tmp_path) == []


def test_an_evaluation_between_steps_leaves_the_ring_and_the_steps_alone(gpt, tmp_path, monkeypatch):
    """An evaluation of a schedule stepping blocks from disk runs the forwards alone (NOTE:
    [Forward-only evaluation]): its loss is the next step's, the ring takes no states in, and
    training after it steps as training without it, to the bit."""
    import torch

    from lazytrain.runtime import forward_only
    from lazytrain.runtime import trainer as trainer_module

    graph, stages, batch, real = gpt
    text = forced(graph, stages, batch, decisions(SPEC), HW).source_text
    (evaluated, model), (plain, other) = two_on_disk(text, real, tmp_path, **HP)
    assert forward_only.whole_step_reason(evaluated) is None
    evaluated.step(batch)
    plain.step(batch)
    forwards, loads = [], []
    monkeypatch.setattr(trainer_module, "forward_loss", lambda r: forwards.append(1) or forward_only.forward_loss(r))
    ring = evaluated.replay.ring
    monkeypatch.setattr(ring, "load", lambda stage, load=ring.load: loads.append(stage) or load(stage))
    loss = evaluated.loss(batch)
    monkeypatch.undo()
    assert forwards and not loads and torch.isfinite(loss)
    steps = [(evaluated.step(batch), plain.step(batch)) for _ in range(2)]
    assert torch.equal(loss, steps[0][0])  # the next step's forward, at the same weights
    assert all(torch.equal(a, b) for a, b in steps)
    evaluated.sync_model()
    plain.sync_model()
    for (name, a), b in zip(model.named_parameters(), other.parameters()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("clipping", ["off", "previous-norm"])
def test_8bit_steps_from_disk_equal_those_in_memory(tmp_path, clipping):
    graph, stages, batch, real = _stages("8bit", clipping)
    texts = [forced(graph, stages, batch, decisions(spec), HW).source_text for spec in (IN_MEMORY, SPEC)]
    assert_same_steps(texts, real, batch, tmp_path, **HP, **({"max_grad_norm": 0.05} if clipping != "off" else {}))


def test_resume_is_bit_identical(gpt, tmp_path):
    graph, stages, batch, real = gpt
    text = forced(graph, stages, batch, decisions(SPEC), HW).source_text
    assert_disk_resume_bit_identical(text, real, batch, tmp_path, **HP)


def test_only_the_ring_holds_their_states_on_the_host(gpt, tmp_path):
    """The ring's three buffers, and no staging buffer of the host-stepped kind beside them (the
    plan counts none)."""
    graph, stages, batch, real = gpt
    trainer, _ = bind_source(forced(graph, stages, batch, decisions(SPEC), HW).source_text, real,
                             offload_dir=str(tmp_path), **HP)
    assert trainer.disk_states.buffers == [] and len(trainer.disk_states.ring.buffers) == DISK_RING
