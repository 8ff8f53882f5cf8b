"""Stage outputs on disk between forward and backward (NOTE: [Activations on disk] in
solver/disk_model.py): the plan takes them off the host, puts them on the disk, keeps a ring of
three buffers on the host and counts the disk's seconds; replay equals eager, AdamW steps equal
torch's, the offload file goes with the trainer, and a step that fails halfway leaves the next a
clean ring. The solver chooses them only where host memory binds and nothing else fits."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lazytrain import hardware
from lazytrain.errors import PlanError
from lazytrain.examples import tiny_gpt
from lazytrain.hardware import HOST_RESERVE
from lazytrain.ir.placement import Outputs
from lazytrain.pipeline import analyse
from lazytrain.runtime.disk_acts import DiskActivations
from lazytrain.runtime.forward_only import whole_step_reason
from lazytrain.runtime.schedule import load_source
from lazytrain.solver.footprint import ACT_RING, disk_act_bytes, disk_io_s
from lazytrain.solver.solve import evaluate, solve
from checks import assert_disk_steps_equal_adamw, bind_source, offload_files
from models import examples, model_pair, token_batch, unique_name
from plans import decisions, forced, repair
from test_forced_plans import check_forced

HW = hardware.load("cpu")
HP = dict(lr=1e-3, eps=1e-6)
# 8 stages; the outputs of stages 0 to 4 (each read by the next, all at most S - 3) go to disk: more
# than the ring's 3 buffers, so offloads wait for the writes that free one, and reads for reloads
IN_MEMORY = ["-Ro"] * 5 + ["-Rk", "-Rk", "-rk"]
SPEC = ["-Rf"] * 5 + ["-Rk", "-Rk", "-rk"]
ON_DISK = range(5)


@pytest.fixture(scope="module")
def gpt():
    meta, real = model_pair(lambda: tiny_gpt.TinyGPT(layers=6))
    batch = token_batch(tiny_gpt.BATCH, tiny_gpt.SEQ, tiny_gpt.VOCAB)
    graph, stages = analyse(meta, batch, HW)
    return graph, dataclasses.replace(stages, disk=True), batch, real


def test_the_plan_moves_the_outputs_to_disk_through_a_ring(gpt):
    _, stages, _, _ = gpt
    in_memory = evaluate(stages, HW, 1 << 40, decisions(IN_MEMORY))
    on_disk = evaluate(stages, HW, 1 << 40, decisions(SPEC))
    regions = [disk_act_bytes(stages[s]) for s in ON_DISK]
    assert on_disk.disk_bytes == sum(regions)
    assert in_memory.host_bytes - on_disk.host_bytes == sum(stages[s].out_bytes for s in ON_DISK) - ACT_RING * max(regions)
    assert on_disk.peak_bytes == in_memory.peak_bytes  # the GPU side is an offload's
    assert on_disk.disk_s == pytest.approx(sum(disk_io_s(n, HW) for n in regions))
    # written by the time the ring needs the buffer, read back by the window before the reload: with
    # a disk far slower than compute, the step waits for it
    slow = evaluate(stages, dataclasses.replace(HW, disk_read_bandwidth=1e4, disk_write_bandwidth=1e4), 1 << 40,
                    decisions(SPEC))
    assert slow.disk_s > 10 * on_disk.step_s and slow.step_s >= slow.disk_s
    assert [d.outputs for d in on_disk.decisions[:5]] == [Outputs.DISK] * 5


def test_they_need_the_option_the_space_and_an_early_last_reader(gpt):
    _, stages, _, _ = gpt
    with pytest.raises(PlanError):  # compiled without --disk
        evaluate(dataclasses.replace(stages, disk=False), HW, 1 << 40, decisions(SPEC))
    with pytest.raises(PlanError):  # read by stage S - 2: its reload is the first thing backward does
        evaluate(stages, HW, 1 << 40, decisions(["-Rk"] * 5 + ["-Rf", "-Rk", "-rk"]))
    need = sum(disk_act_bytes(stages[s]) for s in ON_DISK)
    with pytest.raises(PlanError):
        evaluate(stages, dataclasses.replace(HW, disk_bytes=need - 1), 1 << 40, decisions(SPEC))


@settings(max_examples=examples(15), deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_random_decisions_with_outputs_on_disk(gpt, data):
    """Any valid vector with outputs on disk: verified at its predicted peak, eager's loss and gradients."""
    graph, stages, batch, real = gpt
    raw = data.draw(st.lists(st.tuples(st.booleans(), st.booleans(), st.sampled_from([Outputs.DISK, Outputs.KEEP,
                                                                                      Outputs.DROP]), st.booleans()),
                             min_size=len(stages), max_size=len(stages)))
    check_forced(graph, stages, batch, real, repair(stages, raw))


def test_the_schedule_and_its_summary_say_so(gpt):
    text = forced(*gpt[:3], decisions(SPEC), HW).source_text
    module = load_source(text, unique_name())
    assert [s.placement.outputs.value for s in module.STAGES[:6]] == ["disk"] * 5 + ["keep"]
    assert all(s.out_bytes == gpt[1][s.index].out_bytes for s in module.STAGES[:5])
    assert "outputs disk" in text


def test_replay_and_adamw_steps_with_outputs_on_disk(gpt, tmp_path):
    graph, stages, batch, real = gpt
    trainer = assert_disk_steps_equal_adamw(forced(graph, stages, batch, decisions(SPEC), HW).source_text, real, batch,
                                            tmp_path, **HP)
    assert len(trainer.act_disk.buffers) == ACT_RING and trainer.act_disk.free.qsize() == ACT_RING
    assert trainer.replay.host_act == {}  # no host buffer of their own
    # an evaluation runs the forwards alone (NOTE: [Forward-only evaluation]): no output goes to the
    # disk, and its loss is the next step's
    assert whole_step_reason(trainer) is None
    loss = trainer.loss(batch)
    assert trainer.act_disk.free.qsize() == ACT_RING and not trainer.act_disk.written
    assert torch.equal(loss, trainer.step(batch))
    del trainer
    gc.collect()
    assert offload_files(tmp_path) == []


def test_the_same_steps_as_outputs_in_host_memory(gpt, tmp_path):
    graph, stages, batch, real = gpt
    got = []
    for spec in (IN_MEMORY, SPEC):
        trainer, model = bind_source(forced(graph, stages, batch, decisions(spec), HW).source_text, real,
                                     offload_dir=str(tmp_path), **HP)
        losses = [trainer.step(batch) for _ in range(3)]
        trainer.sync_model()
        got.append((losses, [p.detach().clone() for p in model.parameters()]))
    (l0, w0), (l1, w1) = got
    assert [float(x) for x in l0] == [float(x) for x in l1]
    assert all(torch.equal(a, b) for a, b in zip(w0, w1))


def test_a_step_that_fails_halfway_leaves_a_clean_ring(gpt, tmp_path):
    """Offloads with no reloads (a step that raised in backward): the reads left waiting for a
    buffer are given up, and the next step has every buffer."""
    _, stages, _, _ = gpt
    text = forced(*gpt[:3], decisions(SPEC), HW).source_text
    module = load_source(text, unique_name())
    disk = [s for s in module.STAGES if s.placement.outputs.value == "disk"]
    ring = DiskActivations(disk, [4, 3, 2, 1, 0], tmp_path, None)
    for s in disk:
        outputs = {name: torch.full((4, 8), float(s.index)) for name in s.outputs}
        ring.offload(s.index, outputs, lambda: None)
    ring.begin()
    assert ring.free.qsize() == ACT_RING and ring.held == {}
    for s in disk:  # the ring works again: each stage's outputs come back as they went
        ring.offload(s.index, {name: torch.full((4, 8), float(s.index)) for name in s.outputs}, lambda: None)
    for s in [4, 3, 2, 1, 0]:
        back = ring.reload(s)
        assert all(torch.equal(t, torch.full((4, 8), float(s))) for t in back.values())
        ring.release(s, None)
    ring.begin()
    assert ring.free.qsize() == ACT_RING
    ring.close()


def test_the_solver_takes_them_where_the_host_binds():
    """On the H200 profile, a narrow model on long rows (outputs of 1 MiB a block against 0.2 MiB of
    weights): at the GPU budget and the host of a plan with outputs on disk, the solver's plan fits
    both and keeps outputs on disk; with the whole host, none."""
    hw = hardware.load("h200")
    meta, _ = model_pair(lambda: tiny_gpt.TinyGPT(dim=64, layers=8))
    _, stages = analyse(meta, token_batch(8, 512, tiny_gpt.VOCAB), hw, optimizer_states="8bit")
    stages = dataclasses.replace(stages, disk=True)
    fixed = evaluate(stages, hw, 1 << 40, decisions(["-Rf"] * 7 + ["-Rk", "-Rk", "-rk"]))
    budget = fixed.peak_bytes + hw.allocator_reserve_bytes
    roomy = solve(stages, hw, budget, time_limit=30)
    assert not any(d.outputs is Outputs.DISK for d in roomy.decisions)
    small = dataclasses.replace(hw, host_memory_bytes=fixed.host_bytes + HOST_RESERVE)
    plan = solve(stages, small, budget, time_limit=30)
    assert plan.host_bytes <= small.host_capacity and plan.peak_bytes <= budget - hw.allocator_reserve_bytes
    assert any(d.outputs is Outputs.DISK for d in plan.decisions), plan.decisions
