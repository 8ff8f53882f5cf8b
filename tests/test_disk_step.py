"""Disk-stepped stages (NOTE: [Disk-stepped stages] in solver/disk_model.py): streamed stages whose
optimizer states live in the offload file and whose step is a job on the host worker that reads
them, steps on the device in one shared slot, and writes them back. The plan counts the states off
the host and on the disk, the slot in every window and the job's seconds; the runtime's steps
equal torch.optim.AdamW's (32-bit states) and the GPU step at the prefetch's (8-bit states); a
resumed run is bit-identical."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from lazytrain import hardware
from lazytrain.errors import PlanError
from lazytrain.ir.events import Kind, Stream
from lazytrain.pipeline import analyse
from lazytrain.runtime.schedule import load_source
from lazytrain.solver import formulation
from lazytrain.solver.footprint import disk_gpu_job_s, disk_gpu_state_bytes, disk_step_slot, flush_bytes
from lazytrain.solver.solve import evaluate, solve
from lazytrain.summary import summary
from checks import assert_disk_resume_bit_identical, assert_disk_steps_equal_adamw, assert_same_steps, offload_files
from models import tiny_gpt_pair, unique_name
from plans import decisions, forced

HW = hardware.load("cpu")
HP = dict(lr=1e-3, eps=1e-6)
IN_MEMORY = ["-rk", "GRk", "SRk", "GRk", "-rk"]
SPEC = ["-rk", "XRk", "SRk", "XRk", "-rk"]  # blocks.0 and blocks.2 disk-stepped; blocks.1 host-stepped


def _stages(states: str = "32bit"):
    meta, real, batch = tiny_gpt_pair()
    graph, stages = analyse(meta, batch, HW, optimizer_states=states)
    return graph, dataclasses.replace(stages, disk=True), batch, real


@pytest.fixture(scope="module")
def gpt():
    return _stages()


def test_the_plan_counts_disk_stepped_states_off_the_host(gpt):
    graph, stages, batch, _ = gpt
    in_memory = evaluate(stages, HW, 1 << 40, decisions(IN_MEMORY))
    on_disk = evaluate(stages, HW, 1 << 40, decisions(SPEC))
    moved = [disk_gpu_state_bytes(stages[s].param_numel, stages.state_bytes) for s in (1, 3)]
    assert on_disk.disk_bytes == sum(moved)
    # two staging buffers stay: the job's, and the next one's read ahead (NOTE: [Disk reads ahead])
    assert in_memory.host_bytes - on_disk.host_bytes == sum(moved) - 2 * max(moved)
    slot = max(disk_step_slot(stages, s) for s in (1, 3))
    assert slot < max(flush_bytes(stages, s) for s in (1, 3))  # one tensor at a time, not the whole stage
    schedule = forced(graph, stages, batch, decisions(SPEC), HW).schedule
    buffers = {b.name: b for b in schedule.buffers}
    assert buffers["dstep"].bytes == slot and buffers["dstep"].persistent and buffers["dstep"].pool == "gpu"
    jobs = {e.stage: e for e in schedule.events if e.kind is Kind.OPT_STEP and e.device == "disk"}
    assert sorted(jobs) == [1, 3]
    assert all(e.stream is Stream.CPU for e in jobs.values())
    for s, e in jobs.items():
        g = stages[s]
        assert e.duration_s == pytest.approx(disk_gpu_job_s(g.param_bytes, g.param_numel, len(g.params), HW,
                                                            stages.state_bytes, stages.master_bytes))
    # nothing of the optimizer moves at the prefetch: no opt slot, a plain weight prefetch
    assert not any(b.startswith("opt:") for b in buffers)
    assert not any(e.kind is Kind.OPT_STEP and e.device == "gpu" and e.stage in (1, 3) for e in schedule.events)
    text = summary(load_source(forced(graph, stages, batch, decisions(SPEC), HW).source_text, unique_name()))
    assert "in a job of its own, states on disk" in text and "; disk " in text


def test_disk_steps_need_the_option_and_the_space(gpt):
    _, stages, _, _ = gpt
    with pytest.raises(PlanError):  # compiled without --disk
        evaluate(dataclasses.replace(stages, disk=False), HW, 1 << 40, decisions(SPEC))
    need = sum(disk_gpu_state_bytes(stages[s].param_numel, stages.state_bytes) for s in (1, 3))
    with pytest.raises(PlanError):
        evaluate(stages, dataclasses.replace(HW, disk_bytes=need - 1), 1 << 40, decisions(SPEC))
    assert evaluate(stages, dataclasses.replace(HW, disk_bytes=need), 1 << 40, decisions(SPEC)).disk_bytes == need


def test_the_solver_does_not_search_disk_steps_yet():
    """NOTE: [Disk steps not searched]: a host that only the disk-stepped plan fits is refused (or
    planned without them), never given a plan with them."""
    _, stages, _, _ = _stages("8bit")
    fixed = evaluate(stages, HW, 1 << 40, decisions(["-rk", "XRk", "XRk", "XRk", "-rk"]))
    small = dataclasses.replace(HW, host_memory_bytes=fixed.host_bytes)
    try:
        plan = solve(stages, small, fixed.peak_bytes + HW.allocator_reserve_bytes, time_limit=20)
    except PlanError:
        return
    assert not any(d.kind == "job" for d in plan.decisions)


def test_replay_and_adamw_steps_stepped_from_disk(gpt, tmp_path):
    graph, stages, batch, real = gpt
    trainer = assert_disk_steps_equal_adamw(forced(graph, stages, batch, decisions(SPEC), HW).source_text, real, batch,
                                            tmp_path, **HP)
    # between steps the disk-stepped stages' states are on disk only
    homes = [trainer.store.home[p] for s in (1, 3) for p in trainer.stages[s].params]
    assert all("exp_avg" not in trainer.optimizer.state[p] for p in homes)
    assert all(trainer.optimizer.state[p]["step"] == 3 for p in homes)
    del trainer
    gc.collect()
    assert offload_files(tmp_path) == []


def test_8bit_steps_from_disk_equal_those_at_the_prefetch(tmp_path):
    """The same bitsandbytes step, run by a disk job instead of at the next prefetch: the same
    weights after 3 steps, to the bit."""
    graph, stages, batch, real = _stages("8bit")
    texts = [forced(graph, stages, batch, decisions(spec), HW).source_text for spec in (IN_MEMORY, SPEC)]
    assert_same_steps(texts, real, batch, tmp_path, **HP)


def test_resume_stepped_from_disk_is_bit_identical(gpt, tmp_path):
    """2 steps, a checkpoint, a new trainer loading it, 1 step: the same weights as 3 uninterrupted
    steps, to the bit."""
    graph, stages, batch, real = gpt
    text = forced(graph, stages, batch, decisions(SPEC), HW).source_text
    assert_disk_resume_bit_identical(text, real, batch, tmp_path, **HP)


def test_the_next_jobs_states_are_read_ahead_into_the_other_buffer(tmp_path):
    """NOTE: [Disk reads ahead] in runtime/disk_states.py: while one stage's states are loaded, the
    next one's are read into the second buffer; a third finds none free and waits its turn; each
    stage's states come back as they were stored."""
    from lazytrain.sizes import DISK_ALIGN
    from lazytrain.runtime.disk_states import DiskStates
    from lazytrain.runtime.optim import staged_optimizer
    from lazytrain.runtime.pinned import PinnedArena

    params = [torch.nn.Parameter(torch.zeros(1000 + 24 * i)) for i in range(3)]
    opt = staged_optimizer("32bit", [{"params": [p]} for p in params], **HP)
    states = DiskStates(opt, {i: [p] for i, p in enumerate(params)}, tmp_path, PinnedArena(False),
                        always_fresh=frozenset(range(3)), ahead=frozenset(range(3)))
    largest = max(states.stage_bytes.values())  # two buffers of it, page-aligned for direct transfers
    assert [(b.numel(), b.data_ptr() % DISK_ALIGN) for b in states.buffers] == [(largest, 0), (largest, 0)]
    for i, p in enumerate(params):  # first steps: fresh states, given values, to disk
        states.load(i)
        opt.state[p]["exp_avg"].fill_(i + 1)
        opt.state[p]["exp_avg_sq"].fill_(10 * (i + 1))
        states.store(i)
        assert "exp_avg" not in opt.state[p]
    states.load(0)
    states.read_ahead(1)
    assert sorted(states.held.values()) == [0, 1]
    states.read_ahead(2)  # both buffers held: read when its turn comes
    assert 2 not in states.held and 2 not in states.reads
    states.store(0)
    states.load(1)
    assert states.held == {1: 1} and 1 not in states.reads  # read ahead: loaded in place
    assert torch.equal(opt.state[params[1]]["exp_avg"], torch.full_like(params[1], 2.0))
    states.read_ahead(2)
    assert states.held == {1: 1, 2: 0}
    states.store(1)
    states.load(2)
    assert torch.equal(opt.state[params[2]]["exp_avg"], torch.full_like(params[2], 3.0))
    assert torch.equal(opt.state[params[2]]["exp_avg_sq"], torch.full_like(params[2], 30.0))
    states.store(2)
    states.load(1)
    assert torch.equal(opt.state[params[1]]["exp_avg_sq"], torch.full_like(params[1], 20.0))


def test_host_jobs_with_a_deadline_run_the_most_urgent_ready_one_first():
    """NOTE: [Host jobs by deadline] in runtime/streams.py: each turn runs the most urgent job whose
    events have completed, so a job submitted later but due sooner overtakes, and one not yet
    ready waits for its own turn."""
    from lazytrain.runtime.streams import DeadlineJobs

    class Ev:
        def __init__(self, done):
            self.done = done

        def query(self):
            return self.done

        def synchronize(self):
            self.done = True

    jobs, ran = DeadlineJobs(), []
    events = {name: [Ev(ready)] for name, ready in (("a", True), ("b", False), ("c", True))}
    futures = {name: jobs.add(due, events[name], lambda name=name: ran.append(name) or name)
               for name, due in (("a", 5), ("b", 1), ("c", 2))}
    assert jobs.next_due() == 1
    for name in "abc":  # the turns, in the order submitted, each after its own job's events
        jobs.turn(events[name])
    assert ran == ["c", "b", "a"]
    assert all(f.result() == name for name, f in futures.items()) and jobs.next_due() is None


def test_a_job_released_last_and_due_first_gets_time_of_its_own():
    """NOTE: [Jobs due in release order's reverse] in solver/backlog.py: for each stage k, the
    host work of stages 0..k and the longest disk-stepped job (one running when k's is released)
    fit between k's release and its deadline, in the plan's windows. With
    compute 12 times slower and the disk 4 times, block 1's job fits in its own long backward
    window, and block 0's job, released last, must not count on that time."""
    from lazytrain.solver.backlog import job_intervals

    slow = dataclasses.replace(HW, achieved_fraction=HW.achieved_fraction / 12,
                               disk_read_bandwidth=HW.disk_read_bandwidth / 4,
                               disk_write_bandwidth=HW.disk_write_bandwidth / 4)
    meta, _, batch = tiny_gpt_pair()
    _, stages = analyse(meta, batch, slow, optimizer_states="8bit")
    stages = dataclasses.replace(stages, disk=True, clipping="off")  # released as their gradients land
    spec = decisions(["-rk", "-rk", "XRk", "XRk", "-rk"])
    _, _, model, _ = formulation._build(stages, slow, 1 << 40, minimise_memory=False, fixed=spec)
    S = len(stages)
    labels = [f"F{s}" for s in range(S)] + [f"B{s}" for s in reversed(range(S))] + ["pre", "tail"]
    intervals = [[labels[t] for t in windows] for _, windows in job_intervals(model)]
    assert intervals[0] == ["tail"] and intervals[1] == ["tail", "pre"]
    assert intervals[3] == ["B1", "B0", "tail", "pre", "F0", "F1"]  # released at B1, due before F2's prefetch
    plan = evaluate(stages, slow, 1 << 40, spec)
    seconds = {lab: s for lab, _, s in plan.windows}
    job = {s: disk_gpu_job_s(stages[s].param_bytes, stages[s].param_numel, len(stages[s].params), slow,
                             stages.state_bytes, stages.master_bytes) for s in (2, 3)}
    assert seconds["B1"] > job[3]  # block 1's job fits in its own backward window...
    # ...and block 0's has time of its own, after waiting for the longest job, which may be running
    longest = max(job.values())
    assert job[2] + longest <= sum(seconds[w] for w in intervals[2]) * (1 + 1e-6)
    assert job[2] + job[3] + longest <= sum(seconds[w] for w in intervals[3]) * (1 + 1e-6)
