"""Optimizer states on disk: the states of the streamed stages a plan keeps in the offload file between
steps (NOTE: [Disk-resident states] and NOTE: [Disk-stepped stages] in solver/disk_model.py).

Each such stage's step (a host step, or a disk-stepped stage's GPU job, on the single host worker,
so one at a time) runs between `load` and `store`: `load` reads its states from the file into a
page-aligned staging buffer (on its first step, makes them there, as the optimizer would), the step
updates them in place, and `store` writes them back and drops them from the optimizer's state before
the buffer is used again. With disk-stepped stages a second buffer takes the next job's states,
read ahead while one steps (`read_ahead`, NOTE: [Disk reads ahead]). What goes to disk is every tensor the optimizer's first step would
allocate per parameter (torch AdamW's moments; bitsandbytes' 8-bit moments and block maxima); the
step counts and shared constants stay in the state. Between steps the optimizer's state holds none
of these tensors, so `state_dict` and `load_state_dict` go through `materialized` and `absorb`,
which map them from the file (NOTE: [Mapped regions] in disk.py) and write them back: a checkpoint
holds them as it holds every other state, and a resumed run continues from them.
"""

from __future__ import annotations

import contextlib
import queue
import weakref
from concurrent.futures import Future
from pathlib import Path

import torch

from lazytrain.runtime.carve import Carver, nbytes
from lazytrain.runtime.disk import OffloadFile, Worker, staging_buffer
from lazytrain.runtime.disk_masters import DiskMasters
from lazytrain.runtime.pinned import PinnedArena
from lazytrain.sizes import DISK_ALIGN, STATE_RING_SIZE, aligned


def _layout(optimizer, stage: int, p: torch.Tensor) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """The tensors of `p`'s state that its first step makes (and `fresh_state` cuts with `take`),
    by key: (shape, dtype). Probed on the meta device, so nothing is allocated."""
    fresh = optimizer.fresh_state(stage, p, lambda shape, dtype: torch.empty(shape, dtype=dtype, device="meta"))
    return {k: (tuple(v.shape), v.dtype) for k, v in fresh.items()
            if torch.is_tensor(v) and v.device.type == "meta" and v.dim() > 0}


class DiskStates:
    def __init__(self, optimizer, homes: dict[int, list[torch.Tensor]], directory: str | Path,
                 pinned: PinnedArena | None = None, always_fresh: frozenset[int] = frozenset(),
                 ahead: frozenset[int] = frozenset(), ring: frozenset[int] = frozenset(),
                 ring_size: int = STATE_RING_SIZE, masters: DiskMasters | None = None,
                 names: dict[int, tuple[str, ...]] | None = None):
        """`homes`: stage (its optimizer group) -> the parameters its step updates. `pinned`: the
        arena the staging buffers come from, page-locked at their size where it pins (GPU jobs copy
        from them; NOTE: [Pinned arena] in pinned.py). `always_fresh`: stages whose first step makes
        every parameter's states (GPU steps: their gradients are not in `.grad`). `ahead`: stages
        whose states may be read ahead, into a second buffer (NOTE: [Disk reads ahead]). `ring`:
        stages stepped in backward whose states pass through `ring_size` buffers of their own, read
        and written on threads of their own (NOTE: [Backward steps from disk] in solver/disk_model.py).
        `masters`: the masters on disk (NOTE: [Masters on disk] there), and `names`: stage -> its
        parameters' placeholders, which name them there; while its stage steps, `staged` holds each
        of its masters by name, in its ring buffer beside its states."""
        self.optimizer, self.homes, self.always_fresh = optimizer, homes, always_fresh | ring
        self.pin = pinned is not None and pinned.pin
        self.layout = {(s, i): _layout(optimizer, s, p) for s, ps in homes.items() for i, p in enumerate(ps)}
        self.master_file = masters
        self.masters = {(s, i): p for s, ps in (names or {}).items() for i, p in enumerate(ps)
                        if masters is not None and p in masters}
        self.staged: dict[str, torch.Tensor] = {}
        sizes = {self._region(s, i, k): nbytes(shape, dtype)
                 for (s, i), keys in self.layout.items() for k, (shape, dtype) in keys.items()}
        self.file = OffloadFile(directory, sizes)
        self.stage_bytes = {s: staging_bytes([self.layout[s, i] for i in range(len(ps))]
                                             + [{"master": masters.layout[self.masters[s, i]]}
                                                for i in range(len(ps)) if (s, i) in self.masters])
                            for s, ps in homes.items()}
        # the largest stage's, then the largest of those read ahead (NOTE: [Disk reads ahead]); stages
        # stepped in backward have the ring instead (on the H200 the 72B plan's host peak was 1.3 GiB
        # over its plan with an unused staging buffer the size of a layer's states)
        sizes = [max((b for s, b in self.stage_bytes.items() if s not in ring), default=0),
                 max((self.stage_bytes[s] for s in ahead), default=0)]
        self.buffers = [staging_buffer(n, pinned) for n in sizes if n]
        self.held: dict[int, int] = {}  # stage -> the buffer its states are in (loaded, or being read ahead)
        self.reads: dict[int, list] = {}  # stage -> its reads ahead still to be waited for
        self.on_disk: set[tuple[int, int]] = set()  # (stage, parameter index) whose states are in the file
        self.views: set[int] = set()  # addresses of the mapped states `materialized` handed out
        self.ring = _Ring(self, ring, ring_size, pinned) if ring else None

    @staticmethod
    def _region(stage: int, index: int, key: str) -> str:
        return f"{stage}.{index}.{key}"

    def load(self, stage: int) -> None:
        """Before `stage`'s step: its states in a staging buffer (read ahead, or read now), and the
        optimizer's state pointing at them."""
        if stage in self.reads:  # read ahead: its tensors are in place once the reads are done
            for r in self.reads.pop(stage):
                r.result()
            return
        buffer = self._free(self.stage_bytes[stage], required=False)
        if buffer is None:  # another stage's states were read ahead, and this one came first
            for other in list(self.reads):
                self._drop_ahead(other)
            buffer = self._free(self.stage_bytes[stage])
        self.held[stage] = buffer
        self._fill(stage, self.buffers[buffer])

    def _fill(self, stage: int, buffer: torch.Tensor) -> None:
        """`stage`'s states in `buffer`: read from the file, or on its first step made there."""
        carver = Carver(buffer, DISK_ALIGN)
        reads = []
        for i, p in enumerate(self.homes[stage]):
            name = self.masters.get((stage, i))
            if name is not None:  # NOTE: [Masters on disk] in solver/disk_model.py
                self.staged[name] = carver.take(tuple(p.shape), p.dtype)
                reads.append(self.master_file.read(name, self.staged[name]))
            state = self.optimizer.state[p]
            if (stage, i) in self.on_disk:
                reads += self._read(stage, i, carver.take)
            elif stage in self.always_fresh or p.grad is not None:  # a first step: fresh states, in the staging buffer
                fresh = self.optimizer.fresh_state(stage, p, carver.take)
                for k, v in fresh.items():
                    state.setdefault(k, self._kept(v) if torch.is_tensor(v) and k not in self.layout[stage, i] else v)
        for r in reads:
            r.result()

    def _kept(self, v: torch.Tensor) -> torch.Tensor:
        """A state tensor that stays in the optimizer's state (a step count, a quantisation map), in
        memory of its own; page-locked where GPU jobs copy it, as pageable copies wait for the
        device's default stream (NOTE: [Disk reads ahead])."""
        return v.pin_memory() if self.pin and v.device.type == "cpu" else v.clone()

    def read_ahead(self, stage: int) -> None:
        """Start reading `stage`'s states into the buffer the step before it does not hold, where
        they all are on disk and it fits (NOTE: [Disk reads ahead]); `load` waits for them."""
        n = len(self.homes[stage])
        if stage in self.held or any((stage, i) not in self.on_disk for i in range(n)):
            return
        buffer = self._free(self.stage_bytes[stage], required=False)
        if buffer is None:
            return
        self.held[stage] = buffer
        carver = Carver(self.buffers[buffer], DISK_ALIGN)
        self.reads[stage] = [r for i in range(n) for r in self._read(stage, i, carver.take)]

    def _drop_ahead(self, stage: int) -> None:
        """`stage`'s states read ahead, dropped: its reads finished, its buffer free again."""
        for r in self.reads.pop(stage):
            r.result()
        for i, p in enumerate(self.homes[stage]):
            for k in self.layout[stage, i]:
                self.optimizer.state[p].pop(k, None)
        self.held.pop(stage)

    def _free(self, nbytes: int, required: bool = True) -> int | None:
        """The smallest staging buffer no stage holds that fits `nbytes`."""
        held = set(self.held.values())
        fits = [b for b in range(len(self.buffers)) if b not in held and self.buffers[b].numel() >= nbytes]
        if not fits:
            if required:
                raise RuntimeError(f"no staging buffer free for {nbytes} bytes of states (held: {self.held})")
            return None
        return min(fits, key=lambda b: self.buffers[b].numel())

    def store(self, stage: int) -> None:
        """After `stage`'s step: its states back to the file, and out of the optimizer's state."""
        self._write_out(stage)
        self.held.pop(stage, None)

    def _write_out(self, stage: int) -> None:
        writes = []
        for i, p in enumerate(self.homes[stage]):
            name = self.masters.get((stage, i))
            if name in self.staged:  # NOTE: [Masters on disk] in solver/disk_model.py
                writes.append(self.master_file.write(name, self.staged.pop(name)))
            state, keys = self.optimizer.state.get(p, {}), self.layout[stage, i]
            if keys and all(k in state for k in keys):
                # a state `materialized` handed out, loaded back: a copy, so that no direct write reads
                # from a mapping of the range it writes
                writes += [self.file.write(self._region(stage, i, k), state[k].clone() if state[k].data_ptr() in self.views
                                           else state[k].contiguous()) for k in keys]
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
        """Every state on disk in the optimizer's state while the block runs, as its region of the
        file, mapped (NOTE: [Mapped regions] in disk.py): for `state_dict()`, whose result keeps
        them, live as torch's own states are (later steps rewrite them). Mapped, not read: a
        checkpoint of states the plan keeps on disk is written through the page cache, which the
        kernel evicts, not through host memory the plan gave them up (12.7 GB of states beside a
        36 GB host's 31 GiB plan for the 7B at 1 x 65536: bench/README.md, "Checkpoints within the
        plan's host memory")."""
        self.drain()
        for s, i in sorted(self.on_disk):
            state = self.optimizer.state[self.homes[s][i]]
            for k, (shape, dtype) in self.layout[s, i].items():
                state[k] = self.file.mapped(self._region(s, i, k), shape, dtype)
                self.views.add(state[k].data_ptr())
        try:
            yield
        finally:  # new dicts: `state_dict()` returned the old ones, which keep the states
            for s, i in self.on_disk:
                p, keys = self.homes[s][i], self.layout[s, i]
                self.optimizer.state[p] = {k: v for k, v in self.optimizer.state[p].items() if k not in keys}

    def drain(self) -> None:
        """Every write the ring has in flight, done (between steps: before the file is read, or mapped)."""
        if self.ring is not None:
            self.ring.drain()

    def absorb(self) -> None:
        """After the optimizer loaded a state dict: the states it holds for disk stages go to the file."""
        self.drain()
        self.on_disk.clear()
        for s in self.homes:
            self.store(s)


class _Ring:
    """The buffers stages stepped in backward take their states through (NOTE: [Backward steps from
    disk] in solver/disk_model.py). A reader thread reads each stage's states, in the order backward
    steps them, into the next free buffer (waiting for one); the step's fetch waits for its read
    (`load`); once the write-back after the step has landed, a writer thread writes them to the file
    and frees the buffer (`store`). Two threads, so a read waiting for a buffer never holds up the
    write that frees one: with 3 buffers, stage s's write-back is issued (in B(s-1)) before the fetch
    of any stage three or more places after it in backward (at B(s-2) or later) waits for its read."""

    WAIT_S = 600.0  # a read or write that takes longer is a failure, not a wait

    def __init__(self, states: DiskStates, stages: frozenset[int], size: int, pinned: PinnedArena | None):
        # a proxy: the states own the ring, and a cycle would keep their file until a collection
        self.states, self.stages = weakref.proxy(states), stages
        self.buffers = [staging_buffer(max(states.stage_bytes[s] for s in stages), pinned) for _ in range(size)]
        self.free: queue.Queue[int] = queue.Queue()
        for b in range(size):
            self.free.put(b)
        self.held: dict[int, int] = {}  # stage -> its buffer
        self.reads: dict[int, Future] = {}
        self.writes: list[Future] = []
        self.written: dict[int, Future] = {}  # stage -> its last write, which its next read waits for
        self.reader, self.writer = Worker("lazytrain-ring-read"), Worker("lazytrain-ring-write")

    def read(self, order) -> None:
        """This step's reads, in the order its backward steps the stages."""
        for s in order:
            self.reads[s] = self.reader.submit(self._read, s, self.written.get(s))

    def _read(self, stage: int, written: Future | None) -> None:
        if written is not None:  # the last step's states of this stage, in the file first
            written.result(timeout=self.WAIT_S)
        try:
            buffer = self.free.get(timeout=self.WAIT_S)
        except queue.Empty:
            raise RuntimeError(f"no ring buffer came free for stage {stage}'s states in {self.WAIT_S:.0f} s "
                               f"(held: {self.held})") from None
        self.held[stage] = buffer
        self.states._fill(stage, self.buffers[buffer])

    def load(self, stage: int) -> None:
        """Before `stage`'s fetch: its states in a ring buffer."""
        self.reads.pop(stage).result(timeout=self.WAIT_S)

    def store(self, stage: int, landed=None) -> None:
        """After `stage`'s write-back was issued: once `landed` (a CUDA event after it; None when the
        copies were synchronous) has passed, its states to the file and its buffer free."""
        self.written[stage] = self.writer.submit(self._write, stage, landed)
        self.writes.append(self.written[stage])

    def _write(self, stage: int, landed) -> None:
        if landed is not None:
            landed.synchronize()
        self.states._write_out(stage)
        self.free.put(self.held.pop(stage))

    def drain(self) -> None:
        for w in self.writes:
            w.result(timeout=self.WAIT_S)
        self.writes.clear()


def staging_bytes(layouts) -> int:
    """Bytes of staging buffer one stage's states take: each tensor's, rounded up to `DISK_ALIGN`."""
    return sum(aligned(nbytes(shape, dtype), DISK_ALIGN) for keys in layouts for shape, dtype in keys.values())


# NOTE: [Disk reads ahead] Disk-stepped stages' jobs run one after another on the host worker: read
# the states, step on the GPU, write them back. The GPU part's 8-bit kernels go to the device's
# default stream (NOTE: [Optimizer stream] in stepping.py), behind the resident steps queued there
# during backward, each waiting for the compute issued before it: on the H200 (7B at 24 GiB,
# 2026-12-01) a job's GPU part took 0.055 s in the forward and 0.15-0.48 s in backward, against
# 0.27 s to read and 0.18 s to write a layer's states, and the disk sat idle meanwhile (the GPU
# part also waited there itself: its quantisation maps and step counts were pageable, and a
# pageable copy waits for the stream it is queued on; they are page-locked now). So the
# job that runs next on the worker, where it is disk-stepped, has its states read into a second
# staging buffer while the one before it steps and writes back. The job next is the most urgent
# one submitted (NOTE: [Host jobs by deadline] in streams.py); one submitted later may yet be more
# urgent, and then the states read ahead are dropped if its load needs their buffer. At most two
# stages hold a buffer: the job running and the one read ahead.
