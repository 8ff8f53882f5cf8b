"""Random-number generator states, recorded before a random stage's forward and replayed in its recomputes.

NOTE: [RNG replay]
A stage that draws random numbers (dropout, `Stage.random`) may be recomputed like any other: its
forward records the generators' state it starts from (`record`), and each recompute of that stage
in the same step (of dropped outputs, or before its backward) runs under that state (`replay`), so
it draws the same masks. As `torch.utils.checkpoint` does, both the CPU generator and the compute
device's are recorded, and `replay` restores the states it found on exit (`torch.random.fork_rng`):
a recompute leaves the sequence of draws the next forwards see as eager PyTorch would, since
eager draws only in forward. A recompute that skips linears (NOTE: [Skipped recompute] in
analysis/remat.py) draws the same numbers: a linear draws none, and a draw's count depends on shapes,
never on values, so the zeros in place of skipped values change no mask.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RngState:
    cpu: torch.Tensor
    device: torch.Tensor | None  # the compute device's generator; None on the CPU


def _device_module(device: torch.device):
    return None if device.type in ("cpu", "meta") else torch.get_device_module(device.type)


def record(device: torch.device) -> RngState:
    """The generators' states now: the CPU's and `device`'s."""
    mod = _device_module(device)
    return RngState(torch.get_rng_state(), mod.get_rng_state(device) if mod is not None else None)


@contextlib.contextmanager
def replay(state: RngState, device: torch.device):
    """Run the body from `state`; the generators are back where they were afterwards."""
    mod = _device_module(device)
    devices = [device] if mod is not None else []
    with torch.random.fork_rng(devices=devices, device_type=device.type if mod is not None else "cpu"):
        torch.set_rng_state(state.cpu)
        if mod is not None:
            mod.set_rng_state(state.device, device)
        yield
