"""fp32 masters on disk (NOTE: [Masters on disk] in solver/disk_model.py): a step in backward from
disk may keep its master in the offload file beside its states. The plan trades the master's host
bytes for the compute-dtype copy's and counts the disk's bytes and seconds; training equals the
same plan with the masters on the host to the bit; between steps the model's parameter is the
file's region, so its state dict reads what the disk holds and a resumed run is bit-identical; the
solver takes it only where the host binds."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch

from lazytrain import hardware
from lazytrain.errors import PlanError
from lazytrain.examples import tiny_gpt
from lazytrain.hardware import HOST_RESERVE
from lazytrain.ir.placement import PlacementError, Step, Tier
from lazytrain.pipeline import analyse
from lazytrain.runtime.schedule import load_source
from lazytrain.solver.footprint import DISK_RING, disk_gpu_state_bytes, disk_io_s, disk_master_bytes
from lazytrain.solver.solve import evaluate, solve
from lazytrain.summary import summary
from checks import (
    assert_disk_resume_bit_identical, assert_same_steps, assert_train_resumes_bit_identically, assert_steps_agree,
    mapped_ranges, resident_kib, bind_source,
)
from models import disk_gpt, model_pair, unique_name
from plans import builtin_schedule, decisions, forced

HW = hardware.load("cpu")
HP = dict(lr=1e-2, eps=1e-6)
# 6 blocks, 5 stepped in backward from disk (blocks.1 to blocks.5): more than the ring's 3 buffers
STATES = ["-rk", "GRk"] + ["KRk"] * 5 + ["-rk"]
MASTERS = ["-rk", "GRk"] + ["MRk"] * 5 + ["-rk"]
ON_DISK = range(2, 7)


def _mixed(states: str = "32bit", hw=HW, layers: int = 6, dim: int = tiny_gpt.DIM):
    """fp32 masters (the real model), bf16 compute (the captured one)."""
    return disk_gpt(hw, states, "off", layers, dim, compute=torch.bfloat16)


@pytest.fixture(scope="module")
def gpt():
    return _mixed()


def test_the_plan_trades_the_master_for_the_copy(gpt):
    _, stages, _, _ = gpt
    on_host = evaluate(stages, HW, 1 << 40, decisions(STATES))
    on_disk = evaluate(stages, HW, 1 << 40, decisions(MASTERS))
    masters = [disk_master_bytes(stages[s]) for s in ON_DISK]
    copies = [stages[s].param_bytes for s in ON_DISK]
    states = [disk_gpu_state_bytes(stages[s].param_numel, stages.state_bytes) for s in ON_DISK]
    assert on_disk.disk_bytes - on_host.disk_bytes == sum(masters)
    ring = DISK_RING * (max(m + st for m, st in zip(masters, states)) - max(states))
    assert on_host.host_bytes - on_disk.host_bytes == sum(masters) - sum(copies) - ring
    assert on_disk.disk_s - on_host.disk_s == pytest.approx(sum(disk_io_s(n, HW) for n in masters))
    assert on_disk.peak_bytes <= on_host.peak_bytes  # no staging region for the master's cast
    text = summary(load_source(forced(*gpt[:3], decisions(MASTERS), HW).source_text, unique_name()))
    assert "master on disk" in text


def test_it_needs_fp32_masters_of_16_bit_weights_and_a_step_in_backward_from_disk(gpt):
    _, stages, _, _ = gpt
    with pytest.raises(PlanError):  # compiled without --disk
        evaluate(dataclasses.replace(stages, disk=False), HW, 1 << 40, decisions(MASTERS))
    with pytest.raises(PlacementError, match="no optimizer step runs"):  # a step in backward, its states on the host
        Step.in_backward(Tier.HOST, Tier.DISK)
    meta, _ = model_pair(lambda: tiny_gpt.TinyGPT(layers=6))
    _, fp32 = analyse(meta, gpt[2], HW)  # fp32 compute: the master is the weights
    with pytest.raises(PlanError):
        evaluate(dataclasses.replace(fp32, disk=True, clipping="off"), HW, 1 << 40, decisions(MASTERS))


def test_training_equals_the_masters_on_the_host(gpt, tmp_path):
    graph, stages, batch, real = gpt
    texts = [forced(graph, stages, batch, decisions(spec), HW).source_text for spec in (STATES, MASTERS)]
    assert texts[1].count("Tier.DISK, Tier.DISK") == len(ON_DISK)
    # NOTE: [Weights from the master]: only blocks.0 (GPU-stepped at its prefetch) prefetches from its master
    assert texts[0].count("from_master=True") == 1 + len(ON_DISK) and texts[1].count("from_master=True") == 1
    assert_same_steps(texts, real, batch, tmp_path, **HP)


def test_between_steps_the_parameter_is_the_file(gpt, tmp_path):
    graph, stages, batch, real = gpt
    text = forced(graph, stages, batch, decisions(MASTERS), HW).source_text
    trainer, model = bind_source(text, real, offload_dir=str(tmp_path), **HP)
    masters = trainer.disk_masters
    names = {p: trainer.m.PLACEHOLDERS[p][1] for s in ON_DISK for p in trainer.stages[s].params}
    assert set(masters.layout) == set(names)
    moved = []  # each step reads every master into the ring and writes it back from there
    for kind in ("read", "write"):
        def counted(p, tensor, kind=kind, inner=getattr(masters, kind)):
            moved.append((kind, p))
            return inner(p, tensor)
        setattr(masters, kind, counted)
    for _ in range(2):
        trainer.step(batch)
    trainer.sync_model()
    assert sorted(moved) == sorted((kind, p) for kind in ("read", "write") for p in names for _ in range(2))
    assert not trainer.disk_states.staged  # no master held in a ring buffer between steps
    params = dict(model.named_parameters())
    mapped = mapped_ranges(masters.file.path)
    assert all(any(lo <= params[n].data_ptr() < hi for lo, hi in mapped) for n in names.values())
    state = model.state_dict()
    for p, n in names.items():
        on_file = torch.empty_like(params[n])
        masters.file.read(p, on_file).result()
        assert torch.equal(on_file, params[n]) and torch.equal(state[n], on_file), p  # what the model reads is on disk
    # written through the parameter (a resumed run's weights), it reaches the disk for the next step
    p, n = next(iter(names.items()))
    with torch.no_grad():
        params[n].mul_(0.5)
    on_file = torch.empty_like(params[n])
    masters.file.read(p, on_file).result()
    assert torch.equal(on_file, params[n])


def test_resume_is_bit_identical(gpt, tmp_path):
    graph, stages, batch, real = gpt
    text = forced(graph, stages, batch, decisions(MASTERS), HW).source_text
    assert_disk_resume_bit_identical(text, real, batch, tmp_path, **HP)


def test_the_solver_takes_them_where_the_host_binds():
    """On the H200 profile, 12 blocks with fp32 masters and bf16 compute: at the GPU budget and the
    host of a plan with 10 masters on disk, the solver's plan fits both and puts masters on disk;
    with the whole host it puts none there."""
    hw = hardware.load("h200")
    _, stages, _, _ = _mixed("8bit", hw=hw, layers=12, dim=256)
    fixed = evaluate(stages, hw, 1 << 40, decisions(["-rk", "GRk"] + ["MRk"] * 10 + ["GRk", "-rk"]))
    budget = fixed.peak_bytes + hw.allocator_reserve_bytes
    roomy = solve(stages, hw, budget, time_limit=20)
    assert not any(d.step.master is Tier.DISK for d in roomy.decisions)
    small = dataclasses.replace(hw, host_memory_bytes=fixed.host_bytes + HOST_RESERVE)
    plan = solve(stages, small, budget, time_limit=20)
    assert plan.host_bytes <= small.host_capacity and plan.peak_bytes <= budget - hw.allocator_reserve_bytes
    assert any(d.step.master is Tier.DISK for d in plan.decisions), plan.decisions


def test_a_copy_of_the_model_is_its_own(gpt, tmp_path):
    """A deep copy of a bound model holds its masters in memory of its own, not the file's."""
    graph, stages, batch, real = gpt
    text = forced(graph, stages, batch, decisions(MASTERS), HW).source_text
    trainer, model = bind_source(text, real, offload_dir=str(tmp_path), **HP)
    trainer.step(batch)
    twin = copy.deepcopy(model)
    before = {n: p.detach().clone() for n, p in twin.named_parameters()}
    trainer.step(batch)
    trainer.sync_model()
    assert all(torch.equal(p, before[n]) for n, p in twin.named_parameters())
    assert not all(torch.equal(p, before[n]) for n, p in model.named_parameters())


def test_train_loads_them_straight_into_the_file(tmp_path):
    """`lazytrain train`'s load puts each master on disk in its region as it reads it from the
    checkpoint (NOTE: [Loading weights] in train/weights.py), so host memory never holds them; bind
    finds them there and writes none again; training equals a bind of the same weights in memory."""
    from safetensors.torch import save_file

    from lazytrain.runtime.disk_masters import DiskMasters
    from lazytrain.train.loop import _materialize
    from lazytrain.train.source import resolve
    from models import tiny_gpt_pair

    meta, real, batch = tiny_gpt_pair()
    graph, stages = analyse(meta.to(torch.bfloat16), batch, HW)
    stages = dataclasses.replace(stages, disk=True, clipping="off")
    text = forced(graph, stages, batch, decisions(["-rk", "GRk", "MRk", "MRk", "-rk"]), HW).source_text
    schedule = load_source(text, unique_name())
    save_file({k: v.clone() for k, v in real.state_dict().items()}, str(tmp_path / "w.safetensors"))
    source = resolve(tiny_gpt.__file__, None, None, str(tmp_path / "w.safetensors"))
    (tmp_path / "offload").mkdir()
    masters = DiskMasters(schedule, tmp_path / "offload")
    model = _materialize(source, schedule, masters)
    targets = {schedule.PLACEHOLDERS[p][1]: p for p in masters.layout}
    assert len(targets) == sum(len(s.params) for s in schedule.STAGES if s.placement.step.master.value == "disk") > 0
    mapped = mapped_ranges(masters.file.path)
    params = dict(model.named_parameters())
    assert all(any(lo <= params[t].data_ptr() < hi for lo, hi in mapped) for t in targets)
    assert all(torch.equal(params[t], real.get_parameter(t)) for t in targets)
    written = []
    masters.write = lambda p, tensor, inner=masters.write: written.append(p) or inner(p, tensor)
    trainer = schedule.bind(model, offload_dir=str(tmp_path / "offload"), disk_masters=masters, **HP)
    assert written == []  # bind found them in place
    assert resident_kib(masters.file.path) == 0  # their pages settled: none held by this process
    other = load_source(text, unique_name()).bind(copy.deepcopy(real), offload_dir=str(tmp_path / "offload"), **HP)
    assert_steps_agree(trainer, other, batch, 3)
    assert sorted(set(written)) == sorted(targets.values())  # each step wrote them back from the ring


def test_train_resumes_masters_on_disk_bit_identically(tmp_path, capsys):
    """`lazytrain train` of the built-in model with fp32 masters of bf16 weights, its blocks stepped in
    backward with masters and states on disk: killed after a checkpoint and resumed, it ends with
    the uninterrupted run's weights, to the bit."""
    schedule = builtin_schedule(tmp_path, lambda n: ["-rk", "GRk"] + ["MRk"] * (n - 3) + ["-rk"], HW, torch.bfloat16)
    assert "Tier.DISK, Tier.DISK" in schedule.read_text()
    assert_train_resumes_bit_identically(schedule, tmp_path, capsys)
