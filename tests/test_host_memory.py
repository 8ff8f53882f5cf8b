"""The plan's host memory: what a GPU machine's process keeps outside any plan (NOTE: [Host reserve])
and the host step's buffers of bf16 masters (NOTE: [Host step buffers] in runtime/optim.py)."""

from __future__ import annotations

import dataclasses

import pytest
from models import tiny_gpt_pair
from plans import decisions

from lazytrain import hardware
from lazytrain.errors import PlanError
from lazytrain.hardware import HOST_RESERVE
from lazytrain.pipeline import analyse
from lazytrain.solver.steps import host as host_rule
from lazytrain.solver.footprint import HOST_STEP_BYTES
from lazytrain.solver.solve import evaluate

CPU = hardware.load("cpu")


@pytest.fixture(scope="module")
def stages():
    meta, _, batch = tiny_gpt_pair()
    return analyse(meta, batch, CPU)[1]


def _all_host_stepped(stages):
    return decisions(["SRk"] * (len(stages) - 1) + ["Srk"])


def test_a_gpu_machine_keeps_the_process_reserve_free(stages):
    """A plan whose host bytes fit the machine but not the machine less the process's own memory
    is refused on a GPU profile (the 7B bench with fp32 masters planned 119.2 of 119.2 GiB and the
    process was killed when the host ran out)."""
    decs = _all_host_stepped(stages)
    need = evaluate(stages, CPU, 1 << 40, decs).host_bytes
    gpu = dataclasses.replace(CPU, device="cuda", host_memory_bytes=need + HOST_RESERVE // 2)
    with pytest.raises(PlanError):
        evaluate(stages, gpu, 1 << 40, decs)
    roomy = dataclasses.replace(gpu, host_memory_bytes=need + HOST_RESERVE)
    assert evaluate(stages, roomy, 1 << 40, decs).host_bytes == need
    assert roomy.host_capacity == need and CPU.host_capacity == CPU.host_memory_bytes


def test_bf16_masters_count_the_host_steps_buffers(stages, monkeypatch):
    """With bf16 masters a host-stepped stage steps through an fp32 twin, an fp32 gradient and int32
    noise of its largest tensor, reused across steps: the plan counts them once, for the largest."""
    bf16 = dataclasses.replace(stages, master_bytes=2)
    host_stepped = _all_host_stepped(stages)
    with_buffers = evaluate(bf16, CPU, 1 << 40, host_stepped).host_bytes
    assert evaluate(stages, CPU, 1 << 40, host_stepped).host_bytes > 0  # fp32 masters: no such buffers
    monkeypatch.setattr(host_rule, "HOST_STEP_BYTES", 0)
    without = evaluate(bf16, CPU, 1 << 40, host_stepped).host_bytes
    assert with_buffers - without == HOST_STEP_BYTES * max(g.largest_numel for g in stages)
    resident = decisions(["-Rk"] * (len(stages) - 1) + ["-rk"])
    monkeypatch.setattr(host_rule, "HOST_STEP_BYTES", 12)
    assert evaluate(bf16, CPU, 1 << 40, resident).host_bytes == evaluate(stages, CPU, 1 << 40, resident).host_bytes // 2


def test_a_gpu_plan_keeps_resident_masters_on_the_device_only(stages):
    """NOTE: [Resident masters on the device]: on a GPU a resident stage's master lives on the
    device, so the host counts only streamed stages' masters; on a CPU the device is the host."""
    gpu = dataclasses.replace(CPU, device="cuda", host_memory_bytes=CPU.host_memory_bytes + HOST_RESERVE)
    resident = decisions(["-Rk"] * (len(stages) - 1) + ["-rk"])
    masters = sum(stages.master_bytes * g.param_numel for g in stages)
    assert evaluate(stages, CPU, 1 << 40, resident).host_bytes - evaluate(stages, gpu, 1 << 40, resident).host_bytes == masters
    streamed = _all_host_stepped(stages)
    assert evaluate(stages, gpu, 1 << 40, streamed).host_bytes == evaluate(stages, CPU, 1 << 40, streamed).host_bytes


def test_a_fused_plan_leaves_inductor_its_host_memory():
    """NOTE: [Compiler's host memory]: a plan priced fused on a GPU plans within the host less
    FUSED_HOST_RESERVE beside HOST_RESERVE; eager plans and CPU profiles keep the whole capacity. A
    host that holds an eager plan's streamed weights with 1 MiB to spare holds no fused plan."""
    from lazytrain.errors import InfeasibleBudget
    from lazytrain.hardware import FUSED_HOST_RESERVE
    from lazytrain.pipeline import compile_model

    h200 = hardware.load("h200")
    assert h200.planning(True).host_capacity == h200.host_memory_bytes - HOST_RESERVE - FUSED_HOST_RESERVE
    assert h200.planning(False) is h200 and hardware.load("cpu").planning(True) == hardware.load("cpu")
    meta, _, batch = tiny_gpt_pair()
    eager = compile_model(meta, batch, "min", "h200", fuse_stages=False, time_limit=20).plan
    assert eager.host_bytes > 0  # streamed weights: the premise
    small = dataclasses.replace(h200, host_memory_bytes=eager.host_bytes + HOST_RESERVE + (1 << 20))
    assert compile_model(meta, batch, eager.budget, small, fuse_stages=False, time_limit=20).plan.host_bytes <= \
        small.host_capacity
    with pytest.raises(InfeasibleBudget, match=r"fused stage bodies the plan leaves Inductor 4\.0 GiB of the host"):
        compile_model(meta, batch, eager.budget, small, fuse_stages=True, time_limit=20)
