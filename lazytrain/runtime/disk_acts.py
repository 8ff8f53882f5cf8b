"""Stage outputs on disk between forward and backward (NOTE: [Activations on disk] in
solver/disk_model.py).

A stage whose outputs the plan sends to disk (`outputs_mode` "disk") offloads them as any offloaded
stage does, but into one of `ACT_RING_SIZE` page-locked buffers instead of host memory of its own: the
replay thread takes the next free buffer (waiting for one), copies the outputs into it, and a writer
thread, once that copy has landed, writes the buffer to the stage's region of the offload file and
frees it. After the last such offload of the forward a reader thread reads them back, in the order
backward reloads them, each into the next free buffer; a reload waits for its read, copies the
outputs to the device from the buffer, and the writer thread frees the buffer once that copy has
landed. Reads and reloads go in one order, so the ring never deadlocks: the first `ACT_RING_SIZE` reads
take every buffer and each reload frees one for the next read.

Nothing here outlives a step: `begin` waits for what the last step left in flight and frees every
buffer, so a step that failed halfway leaves the next one a clean ring. Checkpoints hold none of it.
"""

from __future__ import annotations

import queue

import torch

from lazytrain.errors import ScheduleMismatch
from lazytrain.runtime.carve import Carver, nbytes
from lazytrain.runtime.disk import OffloadFile, Worker, staging_buffer
from lazytrain.runtime.pinned import PinnedArena
from lazytrain.sizes import ACT_RING_SIZE, DISK_ALIGN, aligned, disk_region_bytes

_ABANDONED = -1  # in place of a buffer: the step that queued the wait has ended


class DiskActivations:
    WAIT_S = 600.0  # a read or write that takes longer is a failure, not a wait

    def __init__(self, stages, order: list[int], directory, pinned: PinnedArena | None, size: int = ACT_RING_SIZE):
        """`stages`: the schedule's stages whose outputs go to disk (`out_bytes`, `outputs`);
        `order`: their indices in the order backward reloads them."""
        # a split's disk part alone (NOTE: [Boundary tiles] in solver/boundary.py)
        self.sizes = {s.index: disk_region_bytes(s.out_bytes, len(s.outputs), s.placement.split) for s in stages}
        self.order = list(order)
        self.last = max(self.sizes)  # the forward offloads stages in index order: this one comes last
        self.file = OffloadFile(directory, {self._region(s): n for s, n in self.sizes.items()})
        self.buffers = [staging_buffer(max(self.sizes.values()), pinned) for _ in range(size)]
        self.writer, self.reader = Worker("lazytrain-acts-write"), Worker("lazytrain-acts-read")
        self.free: queue.Queue[int] = queue.Queue()
        self.pending: list = []  # futures of this step's writes, reads and frees
        self.begin()

    @staticmethod
    def _region(stage: int) -> str:
        return f"act.{stage}"

    def begin(self) -> None:
        """Before a step: whatever the last one left in flight done (reads still waiting for a
        buffer, after a step that failed, given up), every buffer free."""
        pending, self.pending = self.pending, []
        if pending:  # one for every read that may wait: the old queue goes with this step
            for _ in range(len(self.order) + len(self.buffers)):
                self.free.put(_ABANDONED)
        for f in pending:
            f.exception(timeout=self.WAIT_S)  # a failed step's error was raised where it happened
        self.free = queue.Queue()
        for b in range(len(self.buffers)):
            self.free.put(b)
        self.held: dict[int, int] = {}  # stage -> the buffer its outputs are in
        self.layout: dict[int, list[tuple[str, tuple[int, ...], torch.dtype]]] = {}
        self.written: dict[int, object] = {}  # stage -> its write this step, which its read waits for
        self.reads: dict[int, object] = {}

    def offload(self, stage: int, tensors: dict[str, torch.Tensor], landed) -> None:
        """`stage`'s outputs into a free buffer (copies queued on the current stream), then to the
        file once `landed()` (an event after the copies, or None where they were synchronous) has passed."""
        layout = [(name, tuple(t.shape), t.dtype) for name, t in tensors.items()]
        if (need := _extent(layout)) > self.sizes[stage]:
            raise ScheduleMismatch(f"stage {stage}'s outputs take {need} bytes on disk, more than the "
                                   f"{self.sizes[stage]} the schedule was compiled for; recompile it for this batch")
        buffer = self._take(stage, "offload")
        self.layout[stage] = layout
        carver = Carver(self.buffers[buffer], DISK_ALIGN)
        for t in tensors.values():
            carver.take(t.shape, t.dtype).copy_(t, non_blocking=True)
        self.written[stage] = self.writer.submit(self._write, stage, buffer, landed())
        self.pending.append(self.written[stage])
        if stage == self.last:
            for s in self.order:
                self.reads[s] = self.reader.submit(self._read, s, self.written[s])
            self.pending.extend(self.reads.values())

    def _take(self, stage: int, what: str) -> int:
        try:
            buffer = self.free.get(timeout=self.WAIT_S)
        except queue.Empty:
            raise RuntimeError(f"no ring buffer came free for stage {stage}'s outputs ({what}) in "
                               f"{self.WAIT_S:.0f} s (held: {self.held})") from None
        if buffer == _ABANDONED:
            raise RuntimeError(f"stage {stage}'s outputs ({what}): the step that needed them ended without them")
        self.held[stage] = buffer
        return buffer

    def _used(self, stage: int, buffer: int) -> torch.Tensor:
        """The part of `buffer` `stage`'s outputs take, in whole blocks of `DISK_ALIGN` (direct transfers)."""
        return self.buffers[buffer][:_extent(self.layout[stage])]

    def _write(self, stage: int, buffer: int, landed) -> None:
        if landed is not None:
            landed.synchronize()
        self.file.write(self._region(stage), self._used(stage, buffer)).result(timeout=self.WAIT_S)
        self._release(stage, None)

    def _read(self, stage: int, written) -> None:
        written.result(timeout=self.WAIT_S)  # in the file first
        buffer = self._take(stage, "read back")
        self.file.read(self._region(stage), self._used(stage, buffer)).result(timeout=self.WAIT_S)

    def reload(self, stage: int) -> dict[str, torch.Tensor]:
        """Before `stage`'s reload: its outputs, as views of the buffer they were read into."""
        self.reads.pop(stage).result(timeout=self.WAIT_S)
        carver = Carver(self.buffers[self.held[stage]], DISK_ALIGN)
        return {name: carver.take(shape, dtype) for name, shape, dtype in self.layout[stage]}

    def release(self, stage: int, landed) -> None:
        """After `stage`'s reload copies were queued: its buffer free once `landed` has passed."""
        self.pending.append(self.writer.submit(self._release, stage, landed))

    def _release(self, stage: int, landed) -> None:
        if landed is not None:
            landed.synchronize()
        self.free.put(self.held.pop(stage))

    def close(self) -> None:
        self.file.close()


def _extent(layout) -> int:
    """Bytes tensors of `layout` ((name, shape, dtype), in order) take carved at multiples of
    `DISK_ALIGN`, rounded up to one."""
    end = 0
    for _, shape, dtype in layout:
        end = aligned(end, DISK_ALIGN) + nbytes(shape, dtype)
    return aligned(end, DISK_ALIGN)
