"""Optimizer states on disk: the AdamW moments of the host-stepped stages a plan keeps in the offload
file between steps (NOTE: [Disk-resident states] in passes/step_model.py).

Each such stage's host step (on the single host worker, so one at a time) runs between `load` and
`store`: `load` reads its moments from the file into one page-aligned staging buffer (on its first
step, zeroes them there, as the optimizer would), the step updates them in place, and `store` writes
them back and drops them from the optimizer's state before the next host step reuses the buffer.
The step counts stay in the state (a scalar each). Between steps the optimizer's state holds no
moments of these parameters, so `state_dict` and `load_state_dict` go through `materialized` and
`absorb`, which read them whole from the file and write them back: a checkpoint holds them as it
holds every other state, and a resumed run continues from them.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from lazytrain.runtime.carve import Carver, aligned, nbytes
from lazytrain.runtime.disk import ALIGN, OffloadFile, aligned_empty

MOMENTS = ("exp_avg", "exp_avg_sq", "max_exp_avg_sq")  # torch AdamW's per-element states (the last with amsgrad)


class DiskStates:
    def __init__(self, optimizer, homes: dict[int, list[torch.Tensor]], directory: str | Path):
        """`homes`: stage (its optimizer group) -> the parameters its host step updates."""
        self.optimizer, self.homes = optimizer, homes
        amsgrad = any(g.get("amsgrad") for g in optimizer.param_groups)
        self.keys = MOMENTS if amsgrad else MOMENTS[:2]
        sizes = {self._region(s, i, k): nbytes(p.shape, torch.float32)
                 for s, ps in homes.items() for i, p in enumerate(ps) for k in self.keys}
        self.file = OffloadFile(directory, sizes)
        stage_bytes = [sum(aligned(nbytes(p.shape, torch.float32), ALIGN) for p in ps) * len(self.keys)
                       for ps in homes.values()]
        self.staging = aligned_empty(max(stage_bytes, default=0))
        self.on_disk: set[tuple[int, int]] = set()  # (stage, parameter index) whose moments are in the file

    @staticmethod
    def _region(stage: int, index: int, key: str) -> str:
        return f"{stage}.{index}.{key}"

    def load(self, stage: int) -> None:
        """Before `stage`'s host step: its moments into the staging buffer, and the optimizer's
        state pointing at them."""
        carver = Carver(self.staging, ALIGN)
        reads = []
        for i, p in enumerate(self.homes[stage]):
            state = self.optimizer.state[p]
            if (stage, i) in self.on_disk:
                reads += self._read(stage, i, lambda: carver.take(p.shape, torch.float32))
            elif p.grad is not None:  # a first step: zeroed moments, in the staging buffer
                fresh = self.optimizer.fresh_state(stage, p, carver.take)
                for k, v in fresh.items():
                    state.setdefault(k, v.clone() if k == "step" else v)
        for r in reads:
            r.result()

    def store(self, stage: int) -> None:
        """After `stage`'s host step: its moments back to the file, and out of the optimizer's state."""
        writes = []
        for i, p in enumerate(self.homes[stage]):
            state = self.optimizer.state.get(p, {})
            if all(k in state for k in self.keys):
                writes += [self.file.write(self._region(stage, i, k), state[k]) for k in self.keys]
                self.on_disk.add((stage, i))
        for w in writes:
            w.result()
        for i, p in enumerate(self.homes[stage]):
            for k in self.keys:
                self.optimizer.state.get(p, {}).pop(k, None)

    def _read(self, stage: int, index: int, make) -> list:
        """Parameter `index` of `stage`: its moments read from the file into tensors `make()` gives,
        which its optimizer state then holds; the reads' futures."""
        state = self.optimizer.state[self.homes[stage][index]]
        reads = []
        for k in self.keys:
            state[k] = make()
            reads.append(self.file.read(self._region(stage, index, k), state[k]))
        return reads

    @contextlib.contextmanager
    def materialized(self):
        """Every moment on disk read into the optimizer's state (fresh tensors) while the block runs,
        and dropped again after: for `state_dict()`, whose result keeps them."""
        reads = []
        for s, i in sorted(self.on_disk):
            shape = self.homes[s][i].shape
            reads += self._read(s, i, lambda: torch.empty(shape, dtype=torch.float32))
        for r in reads:
            r.result()
        try:
            yield
        finally:  # new dicts: `state_dict()` returned the old ones, which keep the moments
            for s, i in self.on_disk:
                p = self.homes[s][i]
                self.optimizer.state[p] = {k: v for k, v in self.optimizer.state[p].items() if k not in self.keys}

    def absorb(self) -> None:
        """After the optimizer loaded a state dict: the moments it holds for disk stages go to the file."""
        self.on_disk.clear()
        for s in self.homes:
            self.store(s)
