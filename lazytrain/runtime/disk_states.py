"""Optimizer states on disk: the states of the streamed stages a plan keeps in the offload file between
steps (NOTE: [Disk-resident states] and NOTE: [Disk-stepped stages] in passes/step_model.py).

Each such stage's step (a host step, or a disk-stepped stage's GPU job, on the single host worker,
so one at a time) runs between `load` and `store`: `load` reads its states from the file into one
page-aligned staging buffer (on its first step, makes them there, as the optimizer would), the step
updates them in place, and `store` writes them back and drops them from the optimizer's state before
the next step reuses the buffer. What goes to disk is every tensor the optimizer's first step would
allocate per parameter (torch AdamW's moments; bitsandbytes' 8-bit moments and block maxima); the
step counts and shared constants stay in the state. Between steps the optimizer's state holds none
of these tensors, so `state_dict` and `load_state_dict` go through `materialized` and `absorb`,
which read them whole from the file and write them back: a checkpoint holds them as it holds every
other state, and a resumed run continues from them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from lazytrain.runtime.carve import Carver, aligned, nbytes
from lazytrain.runtime.disk import ALIGN, OffloadFile, aligned_empty


def _layout(optimizer, stage: int, p: torch.Tensor) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors of `p`'s state that its first step makes (and `fresh_state` cuts with `take`),
    by key: (shape, dtype). Probed on the meta device, so nothing is allocated."""
    fresh = optimizer.fresh_state(stage, p, lambda shape, dtype: torch.empty(shape, dtype=dtype, device="meta"))
    return {k: (tuple(v.shape), v.dtype) for k, v in fresh.items()
            if torch.is_tensor(v) and v.device.type == "meta" and v.dim() > 0}


class DiskStates:
    def __init__(self, optimizer, homes: dict[int, list[torch.Tensor]], directory: str | Path, pin: bool = False,
                 always_fresh: frozenset[int] = frozenset()):
        """`homes`: stage (its optimizer group) -> the parameters its step updates. `pin`: a
        page-locked staging buffer (GPU jobs copy from it). `always_fresh`: stages whose first
        step makes every parameter's states (GPU steps: their gradients are not in `.grad`)."""
        self.optimizer, self.homes, self.always_fresh = optimizer, homes, always_fresh
        self.layout = {(s, i): _layout(optimizer, s, p) for s, ps in homes.items() for i, p in enumerate(ps)}
        sizes = {self._region(s, i, k): nbytes(shape, dtype)
                 for (s, i), keys in self.layout.items() for k, (shape, dtype) in keys.items()}
        self.file = OffloadFile(directory, sizes)
        stage_bytes = [sum(aligned(nbytes(shape, dtype), ALIGN) for i in range(len(ps))
                           for shape, dtype in self.layout[s, i].values()) for s, ps in homes.items()]
        self.staging = aligned_empty(max(stage_bytes, default=0), pin=pin)
        self.on_disk: set[tuple[int, int]] = set()  # (stage, parameter index) whose states are in the file

    @staticmethod
    def _region(stage: int, index: int, key: str) -> str:
        return f"{stage}.{index}.{key}"

    def load(self, stage: int) -> None:
        """Before `stage`'s step: its states into the staging buffer, and the optimizer's state
        pointing at them."""
        carver = Carver(self.staging, ALIGN)
        reads = []
        for i, p in enumerate(self.homes[stage]):
            state = self.optimizer.state[p]
            if (stage, i) in self.on_disk:
                reads += self._read(stage, i, carver.take)
            elif stage in self.always_fresh or p.grad is not None:  # a first step: fresh states, in the staging buffer
                fresh = self.optimizer.fresh_state(stage, p, carver.take)
                for k, v in fresh.items():
                    state.setdefault(k, v.clone() if torch.is_tensor(v) and k not in self.layout[stage, i] else v)
        for r in reads:
            r.result()

    def store(self, stage: int) -> None:
        """After `stage`'s step: its states back to the file, and out of the optimizer's state."""
        writes = []
        for i, p in enumerate(self.homes[stage]):
            state, keys = self.optimizer.state.get(p, {}), self.layout[stage, i]
            if keys and all(k in state for k in keys):
                writes += [self.file.write(self._region(stage, i, k), state[k].contiguous()) for k in keys]
                self.on_disk.add((stage, i))
        for w in writes:
            w.result()
        for i, p in enumerate(self.homes[stage]):
            for k in self.layout[stage, i]:
                self.optimizer.state.get(p, {}).pop(k, None)

    def _read(self, stage: int, index: int, make) -> list:
        """Parameter `index` of `stage`: its states read from the file into tensors `make(shape,
        dtype)` gives, which its optimizer state then holds; the reads' futures."""
        state = self.optimizer.state[self.homes[stage][index]]
        reads = []
        for k, (shape, dtype) in self.layout[stage, index].items():
            state[k] = make(shape, dtype)
            reads.append(self.file.read(self._region(stage, index, k), state[k]))
        return reads

    @contextlib.contextmanager
    def materialized(self):
        """Every state on disk read into the optimizer's state (fresh tensors) while the block runs,
        and dropped again after: for `state_dict()`, whose result keeps them."""
        reads = []
        for s, i in sorted(self.on_disk):
            reads += self._read(s, i, lambda shape, dtype: torch.empty(shape, dtype=dtype))
        for r in reads:
            r.result()
        try:
            yield
        finally:  # new dicts: `state_dict()` returned the old ones, which keep the states
            for s, i in self.on_disk:
                p, keys = self.homes[s][i], self.layout[s, i]
                self.optimizer.state[p] = {k: v for k, v in self.optimizer.state[p].items() if k not in keys}

    def absorb(self) -> None:
        """After the optimizer loaded a state dict: the states it holds for disk stages go to the file."""
        self.on_disk.clear()
        for s in self.homes:
            self.store(s)
