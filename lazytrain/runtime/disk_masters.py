"""The fp32 masters a schedule keeps on disk (NOTE: [Masters on disk] in solver/disk_model.py): one
offload file with a region per parameter, named by its placeholder.

Between steps each such master *is* its region: the model's parameter holds a shared mapping of it
(NOTE: [Mapped regions] in disk.py). A master enters the file one tensor at a time, so host memory
never holds more than one of them beyond what the plan counts: `bind` moves each after making the
compute-dtype copy its prefetches read (`adopt`), and `lazytrain train` loads each from the
checkpoint straight into its region (`place`), before `bind`, which then finds it there. While a
step in backward holds a master, it is in a ring buffer (runtime/disk_states.py reads and writes
it with `read` and `write`).
"""

from __future__ import annotations

import tempfile
from concurrent.futures import Future
from pathlib import Path

import torch

from lazytrain.ir.placement import Tier
from lazytrain.runtime.carve import nbytes
from lazytrain.runtime.disk import OffloadFile


def masters_on_disk(module) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The placeholders of a schedule's masters on disk: (shape, dtype), fp32 (only fp32 masters of
    16-bit weights go there)."""
    return {p: (tuple(module.PLACEHOLDERS[p][2]), torch.float32)
            for s in module.STAGES if s.placement.step.master is Tier.DISK for p in s.params}


class DiskMasters:
    def __init__(self, module, directory: str | Path | None = None):
        """The file for `module`'s masters on disk, preallocated in `directory` (default: the temp
        directory), as `--offload-dir` places the other offload files."""
        self.layout = masters_on_disk(module)
        self.file = OffloadFile(directory or tempfile.gettempdir(), {p: nbytes(*lay) for p, lay in self.layout.items()})
        self._mapped: dict[str, torch.Tensor] = {}
        self._unsettled: set[str] = set()  # mapped regions whose pages may be in memory

    def __contains__(self, p: str) -> bool:
        return p in self.layout

    def place(self, p: str):
        """A maker of `p`'s tensor, `(shape, dtype) -> tensor`, for a loader that fills each tensor
        it makes before it makes the next (NOTE: [Loading weights] in train/weights.py): its region;
        those filled before it are settled first, so the page cache holds one at a time."""
        def make(shape, dtype) -> torch.Tensor:
            if (tuple(shape), dtype) != self.layout[p]:
                raise ValueError(f"{p}'s master on disk is {self.layout[p]}, not {(tuple(shape), dtype)}")
            self.settle()
            return self._map(p)
        return make

    def adopt(self, p: str, master: torch.Tensor) -> None:
        """`master` (`p`'s parameter) made its region, its values written there first unless it is
        the region already; its own memory goes with the last reference to it."""
        if (tuple(master.shape), master.dtype) != self.layout[p]:
            raise ValueError(f"{p}'s master on disk is {self.layout[p]}; the model's is "
                             f"{(tuple(master.shape), master.dtype)}")
        held = self._mapped.get(p)
        if held is None or held.data_ptr() != master.data_ptr():
            self.file.write(p, master.detach().contiguous()).result()
            master.data = self._map(p)
        self._unsettled.add(p)  # read for its compute-dtype copy, or filled by a loader
        self.settle()

    def settle(self) -> None:
        """Pages of the regions filled or read through their mappings so far, written back and
        dropped (NOTE: [Mapped regions] in disk.py): a builder that fills them in its own order
        calls it when done."""
        for p in sorted(self._unsettled):
            self.file.settle(p)
        self._unsettled.clear()

    def _map(self, p: str) -> torch.Tensor:
        self._mapped[p] = self.file.mapped(p, *self.layout[p])
        self._unsettled.add(p)
        return self._mapped[p]

    def read(self, p: str, into: torch.Tensor) -> Future:
        return self.file.read(p, into)

    def write(self, p: str, tensor: torch.Tensor) -> Future:
        return self.file.write(p, tensor)
