"""The disk tier (NOTE: [Disk-resident states] in solver/disk_model.py): host-stepped stages' AdamW
moments kept in the offload file between steps. The plan counts them off the host and on the disk,
with one staging buffer and the disk's time in the host step; the runtime's steps equal
torch.optim.AdamW's, a resumed run is bit-identical, and a bad offload directory or a small disk
is refused at bind."""

from __future__ import annotations

import dataclasses
import gc

import pytest
import torch

from lazytrain import hardware
from lazytrain.errors import InfeasibleBudget, PlanError, ResourceError
from lazytrain.ir.events import Kind
from lazytrain.ir.placement import Tier
from lazytrain.pipeline import analyse
from lazytrain.runtime import disk as disk_io
from lazytrain.runtime.schedule import load_source
from lazytrain.solver.footprint import disk_io_s, disk_state_bytes, disk_step_s
from lazytrain.solver.solve import evaluate, smallest_budget, solve
from lazytrain.summary import summary
from lazytrain.units import format_size
from checks import (
    mapped_ranges, assert_steps_agree, assert_disk_resume_bit_identical, assert_train_resumes_bit_identically,
    assert_disk_steps_equal_adamw, assert_same_steps, bind_source, offload_files, two_on_disk,
)
from models import tiny_gpt_pair, unique_name
from plans import builtin_schedule, decisions, forced

HW = hardware.load("cpu")
HP = dict(lr=1e-3, eps=1e-6)
# blocks.0 and blocks.2 with their states on disk; blocks.1 host-stepped in memory
SPEC = ["-rk", "DRk", "SRk", "DRk", "-rk"]


@pytest.fixture(scope="module")
def gpt():
    meta, real, batch = tiny_gpt_pair()
    graph, stages = analyse(meta, batch, HW)
    return graph, dataclasses.replace(stages, disk=True), batch, real


def test_the_plan_counts_disk_states_off_the_host(gpt):
    """Each disk stage's moments leave the host and land on the disk; one staging buffer of the
    largest stays; its host step takes the disk's read and write on top."""
    graph, stages, batch, _ = gpt
    in_memory = evaluate(stages, HW, 1 << 40, decisions(["-rk", "SRk", "SRk", "SRk", "-rk"]))
    on_disk = evaluate(stages, HW, 1 << 40, decisions(SPEC))
    moved = [disk_state_bytes(stages[s].param_numel) for s in (1, 3)]
    assert on_disk.disk_bytes == sum(moved)
    assert in_memory.host_bytes - on_disk.host_bytes == sum(moved) - max(moved)
    schedule = forced(graph, stages, batch, decisions(SPEC), HW).schedule
    steps = {e.stage: e.duration_s for e in schedule.events if e.kind is Kind.OPT_STEP}
    plain = {e.stage: e.duration_s for e in forced(graph, stages, batch, decisions(["-rk", "SRk", "SRk", "SRk", "-rk"]),
                                                    HW).schedule.events if e.kind is Kind.OPT_STEP}
    assert steps[1] - plain[1] == pytest.approx(disk_step_s(stages[1].param_numel, HW))
    assert steps[2] == plain[2]
    assert on_disk.disk_s == pytest.approx(sum(disk_step_s(stages[s].param_numel, HW) for s in (1, 3)))
    text = summary(load_source(forced(graph, stages, batch, decisions(SPEC), HW).source_text, unique_name()))
    assert "; disk " in text and "read and written each step" in text and "states on disk" in text


def test_a_round_trip_moves_at_the_rate_of_reads_and_writes_at_once():
    # NOTE: [Disk reads and writes at once]: with the rate measured, a byte read and written back
    # costs 2 / that rate; without it, the two one after the other
    series = dataclasses.replace(HW, disk_read_bandwidth=1e9, disk_write_bandwidth=2e9, disk_duplex_bandwidth=0.0)
    assert disk_io_s(6_000_000, series) == pytest.approx(6e-3 + 3e-3)
    both = dataclasses.replace(series, disk_duplex_bandwidth=1.5e9)
    assert disk_io_s(6_000_000, both) == pytest.approx(8e-3)
    assert disk_io_s(0, both) == 0.0
    assert hardware.load("h200").disk_duplex_bandwidth > 0  # the box's, measured


def test_disk_states_need_the_option_and_the_space(gpt):
    _, stages, _, _ = gpt
    with pytest.raises(PlanError):  # compiled without --disk
        evaluate(dataclasses.replace(stages, disk=False), HW, 1 << 40, decisions(SPEC))
    need = sum(disk_state_bytes(stages[s].param_numel) for s in (1, 3))
    with pytest.raises(PlanError):
        evaluate(stages, dataclasses.replace(HW, disk_bytes=need - 1), 1 << 40, decisions(SPEC))
    assert evaluate(stages, dataclasses.replace(HW, disk_bytes=need), 1 << 40, decisions(SPEC)).disk_bytes == need


def test_the_solver_uses_the_disk_where_the_host_runs_short(gpt):
    """A host too small for every stage's states in memory: refused without the disk tier, planned with it."""
    _, stages, _, _ = gpt
    streamed = decisions(["-rk", "SRk", "SRk", "SRk", "-rk"])
    budget = evaluate(stages, HW, 1 << 40, streamed).peak_bytes
    host = evaluate(stages, HW, 1 << 40, decisions(SPEC)).host_bytes
    small = dataclasses.replace(HW, host_memory_bytes=host)
    with pytest.raises(PlanError):
        solve(dataclasses.replace(stages, disk=False), small, budget, time_limit=20)
    plan = solve(stages, small, budget, time_limit=20)
    assert any(d.step.states is Tier.DISK for d in plan.decisions) and plan.host_bytes <= host
    assert plan.disk_bytes == sum(disk_state_bytes(g.param_numel) for g, d in zip(stages, plan.decisions)
                                  if d.step.states is Tier.DISK)


def test_replay_and_adamw_steps_with_states_on_disk(gpt, tmp_path):
    graph, stages, batch, real = gpt
    trainer = assert_disk_steps_equal_adamw(forced(graph, stages, batch, decisions(SPEC), HW).source_text, real, batch,
                                            tmp_path, **HP)
    # between steps the disk stages' moments are on disk only
    homes = trainer.disk_states.homes
    assert homes and all("exp_avg" not in trainer.optimizer.state[p] for ps in homes.values() for p in ps)
    del trainer
    gc.collect()
    assert offload_files(tmp_path) == []  # the offload file goes with the trainer


def test_resume_with_states_on_disk_is_bit_identical(gpt, tmp_path):
    """2 steps, a checkpoint, a new trainer loading it, 1 step: the same weights as 3 uninterrupted
    steps, to the bit."""
    graph, stages, batch, real = gpt
    text = forced(graph, stages, batch, decisions(SPEC), HW).source_text
    assert_disk_resume_bit_identical(text, real, batch, tmp_path, **HP)


def test_a_state_dict_maps_the_states_on_disk(gpt, tmp_path):
    """`state_dict()` hands out the states on disk as their regions of the file, mapped (NOTE:
    [Mapped regions] in runtime/disk.py), not read into host memory; loaded back, they are copied
    before they are written, and the steps after equal those of a run never saved."""
    graph, stages, batch, real = gpt
    text = forced(graph, stages, batch, decisions(SPEC), HW).source_text
    (saved, _), (whole, _) = two_on_disk(text, real, tmp_path, **HP)
    for _ in range(2):
        saved.step(batch)
        whole.step(batch)
    state = saved.state_dict()
    mapped = mapped_ranges(saved.disk_states.file.path)
    on_disk = [v for s, i in saved.disk_states.on_disk
               for v in state["state"][_index(saved, s, i)].values() if torch.is_tensor(v) and v.dim() > 0]
    assert on_disk and all(any(lo <= v.data_ptr() < hi for lo, hi in mapped) for v in on_disk)
    saved.load_state_dict(state)
    assert_steps_agree(saved, whole, batch, 2)


def _index(trainer, stage: int, i: int) -> int:
    """The optimizer state dict's index of parameter `i` of `stage`."""
    homes = [p for g in trainer.optimizer.param_groups for p in g["params"]]
    return next(j for j, p in enumerate(homes) if p is trainer.disk_states.homes[stage][i])


def test_bind_refuses_a_bad_offload_dir(gpt, tmp_path):
    graph, stages, batch, real = gpt
    text = forced(graph, stages, batch, decisions(SPEC), HW).source_text
    with pytest.raises(ResourceError, match="offload-dir"):
        bind_source(text, real, offload_dir=str(tmp_path / "missing"), **HP)


def test_bind_refuses_a_disk_too_small(gpt, tmp_path, monkeypatch):
    graph, stages, batch, real = gpt
    text = forced(graph, stages, batch, decisions(SPEC), HW).source_text
    monkeypatch.setattr(disk_io.files, "free_bytes", lambda path: 4096)
    with pytest.raises(ResourceError, match="needs about"):
        bind_source(text, real, offload_dir=str(tmp_path), **HP)
    assert offload_files(tmp_path) == []


# ---- lazytrain train ------------------------------------------------------------------------------

def test_train_resumes_states_on_disk_bit_identically(tmp_path, capsys):
    """`lazytrain train` keeps the states under --offload-dir while it runs and in its checkpoints. A run
    killed after its step-2 checkpoint (its later checkpoint removed) and resumed ends with the
    uninterrupted run's weights, to the bit."""
    schedule = builtin_schedule(tmp_path, lambda n: ["-rk"] + ["DRk"] * (n - 2) + ["-rk"], HW)
    assert_train_resumes_bit_identically(schedule, tmp_path, capsys)


def test_train_refuses_a_missing_offload_dir_before_compiling(tmp_path, capsys):
    from lazytrain.cli import main

    code = main(["train", "--steps", "1", "--offload-dir", str(tmp_path / "missing")])
    err = capsys.readouterr().err
    assert code == 2 and "offload directory" in err and "does not exist" in err and err.count("\n") == 1, err


def test_a_refused_budget_names_the_disk_where_it_would_fit(gpt):
    """Host memory binds: without the tier the budget is refused, and the message gives the smaller
    budget the disk tier reaches; with the tier on, the message has no such hint."""
    _, stages, _, _ = gpt
    plain = dataclasses.replace(stages, disk=False)
    small = dataclasses.replace(HW, host_memory_bytes=evaluate(stages, HW, 1 << 40, decisions(
        ["-rk", "DRk", "DRk", "DRk", "-rk"])).host_bytes)
    with_disk = smallest_budget(stages, small)
    assert with_disk < smallest_budget(plain, small)
    with pytest.raises(InfeasibleBudget, match=r"--disk\), where the smallest feasible budget is") as refused:
        solve(plain, small, with_disk, time_limit=20)
    assert format_size(with_disk, round_up=True) in str(refused.value)
    with pytest.raises(InfeasibleBudget) as plain_refusal:
        solve(stages, small, with_disk - 4096, time_limit=20)
    assert "--disk" not in str(plain_refusal.value)


def test_bf16_masters_keep_fp32_moments_on_disk(tmp_path):
    """A bf16 master's host step runs through an fp32 twin (NOTE: [bf16 master weights] in
    runtime/optim.py), so its moments are fp32, as the plan counts them: the file's regions hold
    them, and the steps equal those with the moments in host memory, to the bit."""
    meta, real, batch = tiny_gpt_pair()
    graph, stages = analyse(meta, batch, HW, master_weights="bf16")
    stages = dataclasses.replace(stages, disk=True)
    texts = [forced(graph, stages, batch, decisions(spec), HW).source_text
             for spec in (["-rk", "SRk", "SRk", "SRk", "-rk"], SPEC)]
    assert_same_steps(texts, real.to(torch.bfloat16), batch, tmp_path, **HP)
