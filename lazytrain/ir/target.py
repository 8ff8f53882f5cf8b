"""The device a graph is captured for: the model's weights, buffers and inputs as fake tensors on it.

NOTE: [Capture on the target device]
Model code chooses its path by device type. transformers' MoE experts, for one, count the tokens
per expert with `histc` on float input on the CPU and on int input elsewhere (the CPU kernel has
no int version). A graph captured on the meta device takes the non-CPU path, which fails when the
schedule runs on the CPU. So capture runs the model as on the device type the schedule is compiled
for (the hardware profile's `device`), with every parameter, buffer and input a fake tensor:
shapes, dtypes and device are real, storage is not, so nothing is materialised (a 70B config still
captures on a laptop). The schedule records that device type and `bind` refuses another
(runtime/schedule.py).

For `cuda` the fake tensors sit on the meta device, which stands in for the GPU: a CPU-only torch
build aborts the process on the first fake CUDA tensor an operator guards (no CUDA device guard
is registered), and a GPU machine would answer questions such as the compute capability from its
own GPU, not the profile's. Model code treats meta as an accelerator (its checks single out
"cpu"/"mps"; the branches for other device types are the generic ones, valid on CUDA), and the
graph depends only on the profile, never on the machine that compiles it.
"""

from __future__ import annotations

import contextlib

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from lazytrain.errors import TraceError

CAPTURE_DEVICE = {"cpu": "cpu", "cuda": "meta"}  # schedule's device type -> where its graph is captured


@contextlib.contextmanager
def on_target(model: torch.nn.Module, batch: dict[str, torch.Tensor], device: str):
    """Within the block, `model`'s parameters, buffers and tensor attributes are fake tensors where
    a graph for `device` is captured (tied ones stay tied); yields the batch as fake tensors there.
    Restores the model on exit."""
    if device not in CAPTURE_DEVICE:
        raise TraceError(f"cannot compile for device {device!r}; a hardware profile's device is one of {sorted(CAPTURE_DEVICE)}")
    where = CAPTURE_DEVICE[device]
    mode = FakeTensorMode()
    swapped: list[tuple[dict, str, object]] = []  # (owner dict, key, original): undone in reverse
    fakes: dict[int, torch.Tensor] = {}

    def fake(t: torch.Tensor) -> torch.Tensor:
        if id(t) not in fakes:
            with mode:
                f = torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype, device=where)
            fakes[id(t)] = torch.nn.Parameter(f, t.requires_grad) if isinstance(t, torch.nn.Parameter) else f
        return fakes[id(t)]

    def swap(owner: dict, key: str, value):
        swapped.append((owner, key, owner[key]))
        owner[key] = value

    try:
        for module in model.modules():
            for table in (module._parameters, module._buffers):
                for key, t in list(table.items()):
                    if t is not None:
                        swap(table, key, fake(t))
            for key, t in list(vars(module).items()):  # plain tensor attributes: lifted as constants
                if isinstance(t, torch.Tensor):
                    swap(vars(module), key, fake(t))
        with mode:
            fake_batch = {k: torch.empty(tuple(v.shape), dtype=v.dtype, device=where) for k, v in batch.items()}
        yield fake_batch
    finally:
        for owner, key, original in reversed(swapped):
            owner[key] = original
