"""Whether this machine has room for a plan, its GPU's and its host's, checked before any step runs.

NOTE: [Room on the GPU]
The compiler holds a budget to the hardware profile's memory (`Hardware.check_budget`), but the GPU
a schedule runs on need not be the profile's: `lazytrain train` plans with the `h200` profile on any
GPU unless given another, a schedule is carried between machines, and another process may hold part
of the device. A plan made for more than the device has runs until its peak and then fails with an
out-of-memory error mid-step, or has its cap silently widened to the whole device. So binding on a
GPU refuses a plan whose peak and the caching allocator's room beside it (`ALLOCATOR_ROOM`, the
profile's reserve: NOTE: [Allocator reserve] in hardware/__init__.py), or its budget where that is
less, is more than the device can give this process: what is free there and what this process's
allocator already holds (masters built in place on the device, NOTE: [Masters built in place] in
store.py). The check is necessary, not sufficient: the library workspaces made after it come out of
the 2 GiB a profile's `max` budget keeps beside the plan. On an H100 80GB HBM3 (2026-12-06, 70f305a,
torch 2.11, CUDA 13) the context held 0.51 GiB, and 0.67 GiB outside the allocator after a first
bf16 matmul, so a plan at a profile's `max` there keeps 1.3 GiB clear of them; the same call's
`lazytrain train --budget max` with the `h200` profile was refused before compiling (137.8 GiB
asked, 78.7 GiB free, `--budget 77.1GiB or less` named). A plan priced for another GPU that fits is
not refused: its memory is kept, its times are that GPU's (`lazytrain train` says so).

NOTE: [Room on the host]
A plan's host bytes (master weights, optimizer states, staging buffers: `PREDICTED["host_bytes"]`)
are page-locked or mapped as the trainer binds. Where the machine has less (a profile of a larger
host, or a container's limit), pinning fails part-way through the bind, or the kernel's
out-of-memory killer ends the process without a message. So binding refuses a plan whose host bytes
alone are more than this machine's memory (`host_memory`: its memory, or its container's limit),
or, with several data-parallel ranks on the host, each running the same plan, than its share.
The profile's 2 GiB for the process itself (NOTE: [Host reserve] in hardware/__init__.py) is not
added: the h200 profile's nominal 128 GB is not what the kernel reports there, and its rows ran with
up to 119.1 GiB planned beside that reserve. `lazytrain train` checks a schedule's room on the GPU
and the host before it loads the weights, and says when the profile has more host memory than
this machine.
"""

from __future__ import annotations

import math
import os

import torch

from lazytrain.errors import ResourceError
from lazytrain.hardware import CUDA_RESERVE
from lazytrain.host import host_memory
from lazytrain.runtime.binding import schedule_name
from lazytrain.units import format_size

ALLOCATOR_ROOM = 2 << 30  # NOTE: [Room on the GPU]


def room(device: torch.device) -> tuple[int, int]:
    """The bytes this process can have on `device` (free there, and what its allocator holds), and the device's total."""
    free, total = torch.cuda.mem_get_info(device)
    return free + torch.cuda.memory_reserved(device), total


def most_budget(device: torch.device) -> int:
    """The largest budget worth compiling for `device` now: its room, and at most its memory less
    `CUDA_RESERVE` (what a profile of it gives as `max`)."""
    have, total = room(device)
    return min(have, total - CUDA_RESERVE)


def fix_text(device: torch.device) -> str:
    """What to do when a plan wants more of `device` than it has."""
    most = math.floor(most_budget(device) / (1 << 30) * 10) / 10
    smaller = f"--budget {most:.1f}GiB or less, or " if most >= 1 else ""
    return (f"compile with {smaller}a profile of this machine (`lazytrain profile -o hw.json`, then "
            "--hardware hw.json), or free the GPU of other processes")


def describe(device: torch.device) -> str:
    """`device` and its memory, in a message."""
    have, total = room(device)
    held = total - have
    return (f"{torch.cuda.get_device_name(device)} ({device}) has {format_size(have)} for it "
            f"({format_size(total)} in all, {format_size(held)} held by the CUDA context and other processes)")


def check_host(module) -> None:
    """Refuse a schedule this host cannot hold (NOTE: [Room on the host]): each of the ranks on this
    host (torchrun's LOCAL_WORLD_SIZE) holds as much."""
    need, have = module.PREDICTED.get("host_bytes", 0), host_memory()
    ranks = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1))
    if have is None or need * ranks <= have:
        return
    share = f", {format_size(have // ranks)} for each of its {ranks} ranks" if ranks > 1 else ""
    raise ResourceError(
        f"{schedule_name(module)} was planned on hardware {module.HARDWARE} with {format_size(need, round_up=True)} of host "
        f"memory (master weights, optimizer states, buffers), but this machine has {format_size(have)}{share}: recompile "
        "for a profile of this machine (`lazytrain profile -o hw.json`, then --hardware hw.json), which plans within "
        "its host memory, with --disk to keep states on disk, or with a larger --budget to keep more on the GPU")


def check_room(module, device: torch.device) -> None:
    """Refuse a schedule this GPU cannot hold (NOTE: [Room on the GPU])."""
    need = min(module.BUDGET, module.PREDICTED_PEAK + ALLOCATOR_ROOM)
    have, _ = room(device)
    if need <= have:
        return
    raise ResourceError(
        f"{schedule_name(module)} was planned on hardware {module.HARDWARE} for a {format_size(module.BUDGET, round_up=True)} budget and "
        f"needs {format_size(need, round_up=True)} of the GPU (its peak {format_size(module.PREDICTED_PEAK)} and the "
        f"allocator's room), but {describe(device)}: re{fix_text(device)}")


def check_budget_room(budget, hw, device: torch.device) -> None:
    """Before compiling for `device` (`lazytrain train`): a budget, or the profile's `max`, that
    the device cannot give is refused before the compile rather than at bind (NOTE: [Room on the
    GPU]). `min` plans the least memory any plan can have; bind checks it."""
    want = hw.max_budget if budget in (None, "max") else budget
    if not isinstance(want, int) or want <= room(device)[0]:
        return
    what = (f"--budget {format_size(want, round_up=True)}" if isinstance(budget, int) else
            f"--budget max on hardware profile '{hw.name}' is {format_size(want)} (its GPU has "
            f"{format_size(hw.gpu_memory_bytes)})")
    raise ResourceError(f"{what}, but {describe(device)}: {fix_text(device)}")


def smaller_host(hw) -> str | None:
    """A note where the profile plans for more host memory than this machine has (NOTE: [Room on the host])."""
    have = host_memory()
    if have is None or hw.host_memory_bytes <= have:
        return None
    return (f"note: hardware profile '{hw.name}' plans with {format_size(hw.host_memory_bytes)} of host memory, this "
            f"machine has {format_size(have)}: a plan that needs more than it has is refused before training; "
            "`lazytrain profile -o hw.json`, then --hardware hw.json, plans within this one's")


def other_gpu(hw, device: torch.device) -> str | None:
    """A note where `device` is not the kind of GPU the profile measured (its memory differs by
    more than 1 %): the plan's memory is checked against this GPU, its times are the profile's."""
    total = torch.cuda.get_device_properties(device).total_memory
    if abs(total - hw.gpu_memory_bytes) <= 0.01 * hw.gpu_memory_bytes:
        return None
    return (f"note: this GPU ({torch.cuda.get_device_name(device)}, {format_size(total)}) is not the machine of hardware "
            f"profile '{hw.name}' ({format_size(hw.gpu_memory_bytes)}): the plan's predicted times are that machine's; "
            "`lazytrain profile -o hw.json`, then --hardware hw.json, plans with this one's")
