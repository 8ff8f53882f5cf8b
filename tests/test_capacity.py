"""NOTE: [Room on the GPU] (lazytrain/runtime/capacity.py): a plan the GPU cannot hold is refused
before any step, with the budget that would fit. The device's answers are faked here; the GPU tier
binds a real schedule (tests/test_gpu.py)."""

from types import SimpleNamespace

import pytest
import torch

from lazytrain import hardware, host
from lazytrain.errors import ResourceError
from lazytrain.runtime import capacity

GiB = 1 << 30
H100 = "NVIDIA H100 80GB HBM3"
H100_TOTAL = 85_017_493_504  # what torch reported for one, and free beside its context (2026-12-06)
H100_FREE = 84_465_090_560
DEVICE = torch.device("cuda", 0)


@pytest.fixture
def h100(monkeypatch):
    """A fresh H100, its context holding 0.51 GiB; `held` is what this process's allocator holds."""
    gpu = SimpleNamespace(free=H100_FREE, held=0)
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (gpu.free, H100_TOTAL))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: gpu.held)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: H100)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(total_memory=H100_TOTAL))
    return gpu


def schedule(budget: int, peak: int, host_bytes: int = 0):
    return SimpleNamespace(BUDGET=budget, PREDICTED_PEAK=peak, HARDWARE="h200", __file__="run/schedule.py",
                           PREDICTED={"host_bytes": host_bytes})


def test_an_h200_plan_of_the_whole_device_is_refused_on_an_h100(h100):
    h200 = hardware.load("h200")
    with pytest.raises(ResourceError) as refused:
        capacity.check_room(schedule(h200.max_budget, h200.max_budget - 2 * GiB), DEVICE)
    text = str(refused.value)
    assert "schedule run/schedule.py was planned on hardware h200" in text and H100 in text
    # the most a profile of this GPU would give as max: its memory less 2 GiB, here under its room
    assert "recompile with --budget 77.1GiB or less" in text and "lazytrain profile -o hw.json" in text


def test_a_plan_that_fits_is_bound(h100):
    capacity.check_room(schedule(24 * GiB, int(21.9 * GiB)), DEVICE)
    # a budget nothing caps (1 TiB) with a small peak: the peak and the allocator's room are what it needs
    capacity.check_room(schedule(1 << 40, GiB), DEVICE)
    with pytest.raises(ResourceError, match="needs 79.0 GiB of the GPU"):
        capacity.check_room(schedule(1 << 40, 77 * GiB), DEVICE)


def test_what_the_process_already_holds_counts_and_other_processes_do_not(h100):
    plan = schedule(40 * GiB, 38 * GiB)
    h100.free = 30 * GiB  # another process holds the rest
    with pytest.raises(ResourceError, match=r"has 30.0 GiB for it .*held by the CUDA context and other processes"):
        capacity.check_room(plan, DEVICE)
    h100.held = 20 * GiB  # masters built in place on the device: the plan's own
    capacity.check_room(plan, DEVICE)


def test_a_full_gpu_suggests_no_budget(h100):
    h100.free = GiB // 2
    with pytest.raises(ResourceError) as refused:
        capacity.check_room(schedule(24 * GiB, 22 * GiB), DEVICE)
    assert "--budget" not in str(refused.value) and "free the GPU of other processes" in str(refused.value)


def test_train_refuses_a_budget_before_compiling(h100):
    h200 = hardware.load("h200")
    with pytest.raises(ResourceError, match=r"--budget max on hardware profile 'h200' is 137.8 GiB \(its GPU has 139.8 GiB\)"):
        capacity.check_budget_room("max", h200, DEVICE)
    with pytest.raises(ResourceError, match="--budget 100.0 GiB, but NVIDIA H100"):
        capacity.check_budget_room(100 * GiB, h200, DEVICE)
    capacity.check_budget_room(24 * GiB, h200, DEVICE)
    capacity.check_budget_room("min", h200, DEVICE)  # the least any plan has: bind checks it


def test_another_gpu_than_the_profiles_is_named(h100):
    h200 = hardware.load("h200")
    note = capacity.other_gpu(h200, DEVICE)
    assert note is not None and H100 in note and "predicted times are that machine's" in note
    assert capacity.other_gpu(h200.__class__(**{**vars(h200), "gpu_memory_bytes": H100_TOTAL}), DEVICE) is None


def test_a_plan_with_more_host_memory_than_the_machine_is_refused(monkeypatch):
    monkeypatch.setattr(capacity, "host_memory", lambda: 64 * GiB)
    capacity.check_host(schedule(24 * GiB, 20 * GiB, host_bytes=60 * GiB))
    with pytest.raises(ResourceError, match=r"with 100.0 GiB of host memory .* this machine has 64.0 GiB: recompile"):
        capacity.check_host(schedule(24 * GiB, 20 * GiB, host_bytes=100 * GiB))
    assert "plans with 119.2 GiB of host memory, this machine has 64.0 GiB" in capacity.smaller_host(hardware.load("h200"))
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks on this host, each holding the plan's
    with pytest.raises(ResourceError, match=r"this machine has 64.0 GiB, 32.0 GiB for each of its 2 ranks"):
        capacity.check_host(schedule(24 * GiB, 20 * GiB, host_bytes=60 * GiB))
    monkeypatch.setattr(capacity, "host_memory", lambda: None)  # not known: nothing refused
    capacity.check_host(schedule(24 * GiB, 20 * GiB, host_bytes=100 * GiB))
    assert capacity.smaller_host(hardware.load("h200")) is None


def test_host_memory_is_the_containers_limit_where_that_is_less(monkeypatch, tmp_path):
    limit = tmp_path / "memory.max"
    monkeypatch.setattr(host, "CGROUP_LIMITS", (str(limit), str(tmp_path / "v1")))
    machine = host.host_memory()  # neither file: the machine's pages
    assert machine is not None and machine > 0
    limit.write_text("max\n")
    assert host.host_memory() == machine
    limit.write_text(f"{machine // 2}\n")
    assert host.host_memory() == machine // 2


def test_lazytrain_train_refuses_the_profiles_max_on_a_smaller_gpu_before_compiling(h100, monkeypatch, capsys):
    """The default model with `--budget max` on the h200 profile, on an H100: refused before the
    compile, naming the budget that fits (the same call ran on an H100, NOTE: [Room on the GPU])."""
    from lazytrain import pipeline
    from lazytrain.cli import main

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(pipeline, "compile_model", lambda *a, **k: pytest.fail("compiled"))
    assert main(["train", "--budget", "max", "--steps", "1", "--no-progress"]) != 0
    err = capsys.readouterr().err
    assert "--budget max on hardware profile 'h200' is 137.8 GiB" in err and "--budget 77.1GiB or less" in err
