"""The disk tier's storage: one preallocated file of named regions, written and read in chunks on threads.

NOTE: [Offload files]
The file is preallocated whole when it is opened (`posix_fallocate`): a disk too small for the plan
is a `ResourceError` before the first step, not ENOSPC in the middle of one, hours in. The free
space is checked before anything is created, and again by the preallocation itself.

Transfers use O_DIRECT where the filesystem takes it. Through the page cache, every byte the disk
tier moves out of host memory would stay in host memory as cached pages, which is the resource the
tier exists to save (the kernel drops them only under pressure, once the plan's own buffers feel
it); and reads would come from that cache at memory speed, so measured disk rates would flatter the
disk. On the 2-core CPU machine (2026-12-01), 256 MiB written and read back 4 times: buffered, the
page cache grew by 256 MiB and reads ran at 6.7-7.3 GB/s; direct, it grew by nothing and reads ran
at 1.0-1.4 GB/s (1.3-3.2 GB/s over other runs on that virtual disk).

O_DIRECT needs the memory address, the file offset and the length of each transfer to be multiples
of the logical block size; `DISK_ALIGN` (4096, lazytrain/sizes.py) covers the 512-byte and 4 KiB
sectors disks have. Regions start at multiples of `DISK_ALIGN` and are rounded up to one, and chunks
are multiples of it, so a tensor at a page-aligned address (`aligned_empty`) goes direct in whole
but for its last partial block. That tail, and every chunk of a tensor at an unaligned address
(torch's CPU allocator aligns to 64 bytes only), go through a second, buffered descriptor of the
same file: Linux keeps the two coherent (a direct transfer writes back and drops the cached pages of
its range first), and no file block is shared by a direct and a buffered transfer of one operation.
Where the filesystem refuses O_DIRECT at open (tmpfs before Linux 6.6, platforms without the flag)
or at the first direct transfer (EINVAL: some FUSE and network mounts), everything goes buffered and
`direct` is False. Where `posix_fallocate` is unsupported, the file is only sized (`ftruncate`):
sparse, so a full disk shows up at the write that needs the block, as the same `ResourceError`.

NOTE: [Mapped regions]
A region can also be read as a tensor whose memory is the file itself (`mapped`: a shared mapping
of the buffered descriptor). A master on disk is one between steps (NOTE: [Masters on disk] in
solver/disk_model.py): the model's parameter, so `state_dict`, `sync_model`, checkpoints and
exports read it from the file, and a resumed run's weights written into it reach the file, without
the tier giving it host memory of its own: its pages are the page cache's, which the kernel evicts
under pressure (`settle` writes a region's pages back and drops them at once, where the
file was filled through its mapping: a load, or bind's move). The direct transfers stay coherent with the mapping as with the buffered
descriptor: a direct read writes back the dirty pages of its range first, and a direct write drops
(and unmaps) the cached pages of its range, so the next access reads what it wrote.
"""

from __future__ import annotations

import ctypes
import errno
import mmap
import os
import queue
import threading
import uuid
import weakref
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_all
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from lazytrain import files
from lazytrain.errors import ResourceError
from lazytrain.runtime.carve import nbytes as tensor_bytes  # `OffloadFile.nbytes` is the file's
from lazytrain.sizes import DISK_ALIGN, aligned

if TYPE_CHECKING:
    from lazytrain.runtime.pinned import PinnedArena

# NOTE: [Offload chunks] A transfer is cut into chunks of CHUNK_BYTES run on `threads` threads, so
# that a large tensor keeps several requests in flight (NVMe drives reach their rate only at some
# queue depth) while each request stays large. Not yet tuned on a GPU machine's drive: on the
# 2-core CPU machine's virtual disk (2026-12-01), 256 MiB direct in 1-64 MiB chunks on 1 or 4
# threads moved 2.0-3.2 GB/s either way, 8 MiB on 4 threads among the fastest.
CHUNK_BYTES = 8 << 20
_FIX = ", or point --offload-dir at a larger disk"
_UNSUPPORTED = {errno.EOPNOTSUPP, errno.EINVAL, getattr(errno, "ENOTSUP", errno.EOPNOTSUPP)}


def aligned_empty(nbytes: int, pin: bool = False) -> torch.Tensor:
    """`nbytes` of uint8 host memory starting at a multiple of `DISK_ALIGN`, so that transfers of it can
    go direct (page-locked where `pin`, which needs CUDA)."""
    buf = torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin)
    if buf.data_ptr() % DISK_ALIGN:
        buf = torch.empty(nbytes + DISK_ALIGN, dtype=torch.uint8, pin_memory=pin)
        skip = -buf.data_ptr() % DISK_ALIGN
        buf = buf[skip:skip + nbytes]
    return buf


def check_directory(directory: str | Path) -> Path:
    """`directory` as a Path, if it is an existing directory this process may write in; else
    `ResourceError` naming the fix (`lazytrain train` checks `--offload-dir` before it compiles)."""
    directory = Path(directory)
    if not directory.is_dir():
        what = "is not a directory" if directory.exists() else "does not exist"
        raise ResourceError(f"the offload directory {directory} {what}; pass --offload-dir an existing "
                            "writable directory on a local disk")
    if not os.access(directory, os.W_OK | os.X_OK):
        raise ResourceError(f"the offload directory {directory} is not writable; pass --offload-dir an existing "
                            "writable directory on a local disk")
    return directory


class _Handles:
    """What the transfers and the finalizer share, so that neither keeps the `OffloadFile` alive."""

    def __init__(self, path: Path, buffered: int, direct: int | None, threads: int):
        self.path, self.buffered, self.direct = path, buffered, direct
        self.fds = [fd for fd in (buffered, direct) if fd is not None]
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="lazytrain-disk")
        self.pending: set[Future] = set()
        self.lock = threading.Lock()

    def transfer(self, view: memoryview, address: int, offset: int, write: bool) -> None:
        """Move all of `view` (whose memory starts at `address`) to or from the file at `offset`,
        looping over short transfers; direct where all three are aligned (NOTE: [Offload files])."""
        done = 0
        while done < len(view):
            part, at = view[done:], offset + done
            direct = self.direct
            aligned = (address + done) % DISK_ALIGN == 0 and at % DISK_ALIGN == 0 and len(part) % DISK_ALIGN == 0
            fd = direct if direct is not None and aligned else self.buffered
            try:
                n = os.pwritev(fd, [part], at) if write else os.preadv(fd, [part], at)
            except OSError as exc:
                if fd == direct and exc.errno == errno.EINVAL:  # opened direct, yet refuses direct transfers
                    self.direct = None
                    continue
                if files.is_disk_full(exc):
                    raise files.no_space(self.path, len(part), _FIX) from None
                raise
            if n == 0:
                raise OSError(errno.EIO, f"{'wrote' if write else 'read'} nothing at byte {at} of {self.path}: "
                              "was the file truncated while open?")
            done += n

    def close(self) -> None:
        self.pool.shutdown(wait=True)
        for fd in self.fds:
            os.close(fd)
        self.path.unlink(missing_ok=True)


def _memory(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, any dtype (`.numpy()` refuses bfloat16)."""
    return memoryview((ctypes.c_ubyte * tensor.nbytes).from_address(tensor.data_ptr())).cast("B")


class _Operation:
    """One `write` or `read`: its chunks, the tensor they use, and the future that reports them."""

    def __init__(self, handles: _Handles, tensor: torch.Tensor, chunks: int):
        self.handles, self.tensor, self.left = handles, tensor, chunks
        self.future: Future = Future()
        self.future.set_running_or_notify_cancel()  # its chunks are under way: it cannot be cancelled
        self.error: BaseException | None = None
        self.lock = threading.Lock()

    def chunk_done(self, chunk: Future) -> None:
        with self.lock:
            self.error = self.error or chunk.exception()
            self.left -= 1
            if self.left:
                return
        self.tensor = None  # held until every chunk is done
        with self.handles.lock:
            self.handles.pending.discard(self.future)
        if self.error is not None:
            self.future.set_exception(self.error)
        else:
            self.future.set_result(None)


class OffloadFile:
    """Named regions of one preallocated file in `directory`, for tensors the disk tier holds
    (NOTE: [Offload files]). `write` and `read` return futures; the file is removed on `close`, when
    the object is collected, or at interpreter exit."""

    def __init__(self, directory: str | Path, sizes: dict[str, int], threads: int = 4,
                 chunk_bytes: int = CHUNK_BYTES):
        if chunk_bytes <= 0 or chunk_bytes % DISK_ALIGN:
            raise ValueError(f"chunk_bytes must be a positive multiple of {DISK_ALIGN}, not {chunk_bytes}")
        if threads < 1:
            raise ValueError(f"threads must be at least 1, not {threads}")
        directory = check_directory(directory)
        self.chunk_bytes = chunk_bytes
        self._regions: dict[str, tuple[int, int]] = {}
        offset = 0
        for name, size in sizes.items():
            if size < 0:
                raise ValueError(f"region {name!r} has a negative size ({size})")
            self._regions[name] = (offset, size)
            offset += aligned(size, DISK_ALIGN)
        self._nbytes = offset
        path = directory / f"lazytrain-offload-{os.getpid()}-{uuid.uuid4().hex[:12]}.bin"
        free = files.free_bytes(directory)
        if free is not None and free < self._nbytes:
            raise files.no_space(path, self._nbytes, _FIX)
        try:
            buffered = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0), 0o600)
        except OSError as exc:
            raise ResourceError(f"cannot create the offload file in {directory} ({exc.strerror}); pass "
                                "--offload-dir an existing writable directory on a local disk") from None
        try:
            _preallocate(buffered, self._nbytes)
            direct = _open_direct(path)
        except BaseException as exc:
            os.close(buffered)
            path.unlink(missing_ok=True)
            if isinstance(exc, OSError) and files.is_disk_full(exc):
                raise files.no_space(path, self._nbytes, _FIX) from None
            raise
        self._handles = _Handles(path, buffered, direct, threads)
        self._maps: dict[str, mmap.mmap] = {}  # regions `mapped`, by name
        self._finalizer = weakref.finalize(self, self._handles.close)

    @property
    def path(self) -> Path:
        return self._handles.path

    @property
    def nbytes(self) -> int:
        """Bytes the file takes on disk: every region rounded up to `DISK_ALIGN`."""
        return self._nbytes

    @property
    def direct(self) -> bool:
        """Whether aligned transfers bypass the page cache (O_DIRECT); False where the filesystem refuses it."""
        return self._handles.direct is not None

    @property
    def regions(self) -> dict[str, tuple[int, int]]:
        """Each region's (offset in the file, size in bytes)."""
        return dict(self._regions)

    @property
    def closed(self) -> bool:
        return not self._finalizer.alive

    def write(self, name: str, tensor: torch.Tensor) -> Future:
        """Copy `tensor`'s bytes into region `name`; the future completes when they are in the file."""
        return self._submit(name, tensor, write=True)

    def read(self, name: str, tensor: torch.Tensor) -> Future:
        """Fill `tensor` from the start of region `name`; the future completes when it is filled."""
        return self._submit(name, tensor, write=False)

    def mapped(self, name: str, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """Region `name` as a tensor of `shape` and `dtype` whose memory is the file's own (a shared
        mapping, through the page cache): NOTE: [Mapped regions]. It outlives the file's `close`."""
        if self.closed:
            raise ValueError(f"{self.path} is closed")
        offset, size = self._regions[name]
        count = tensor_bytes(shape, dtype)
        if count > size:
            raise ValueError(f"region {name!r} holds {size} bytes; a {tuple(shape)} {dtype} tensor has {count}")
        if count == 0:  # nothing to map (a zero-length mapping is an error)
            return torch.empty(shape, dtype=dtype)
        start = offset - offset % mmap.ALLOCATIONGRANULARITY
        mapping = mmap.mmap(self._handles.buffered, count + offset - start, mmap.MAP_SHARED,
                            mmap.PROT_READ | mmap.PROT_WRITE, offset=start)
        self._maps[name] = mapping
        return torch.frombuffer(mapping, dtype=torch.uint8, count=count, offset=offset - start).view(dtype).view(shape)

    def settle(self, name: str) -> None:
        """What was written into region `name`'s mapping, in the file; and its pages out of this
        process and the page cache, which they would otherwise hold until the kernel needs the
        memory (NOTE: [Mapped regions])."""
        mapping = self._maps.get(name)
        if mapping is None:  # never mapped, or empty
            return
        mapping.flush()
        if hasattr(mmap, "MADV_DONTNEED"):
            mapping.madvise(mmap.MADV_DONTNEED)
        if hasattr(os, "posix_fadvise"):
            offset, size = self._regions[name]
            os.posix_fadvise(self._handles.buffered, offset, size, os.POSIX_FADV_DONTNEED)

    def wait(self) -> None:
        """Wait until every transfer submitted so far is done (their futures report their errors)."""
        with self._handles.lock:
            pending = list(self._handles.pending)
        wait_all(pending)

    def close(self) -> None:
        """Wait for the transfers, close the file and remove it. Calling it again does nothing."""
        if self._finalizer.alive:
            self.wait()
            self._finalizer()

    def __enter__(self) -> OffloadFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _submit(self, name: str, tensor: torch.Tensor, write: bool) -> Future:
        if self.closed:
            raise ValueError(f"{self.path} is closed")
        if name not in self._regions:
            raise KeyError(f"no region {name!r} in {self.path}; its regions are {sorted(self._regions)}")
        if tensor.device.type != "cpu":
            raise ValueError(f"region {name!r}: disk transfers take CPU tensors, not {tensor.device} ones")
        if not tensor.is_contiguous():
            raise ValueError(f"region {name!r}: disk transfers take contiguous tensors (call .contiguous())")
        offset, size = self._regions[name]
        if tensor.nbytes > size:
            raise ValueError(f"region {name!r} holds {size} bytes; a {tuple(tensor.shape)} {tensor.dtype} "
                             f"tensor has {tensor.nbytes}")
        view, address = (_memory(tensor) if tensor.nbytes else memoryview(b"")), tensor.data_ptr()
        pieces = list(_chunks(len(view), self.chunk_bytes))
        handles = self._handles
        op = _Operation(handles, tensor, len(pieces))
        if not pieces:
            op.future.set_result(None)
            return op.future
        with handles.lock:
            handles.pending.add(op.future)
        for start, stop in pieces:
            chunk = handles.pool.submit(handles.transfer, view[start:stop], address + start, offset + start, write)
            chunk.add_done_callback(op.chunk_done)
        return op.future


def _chunks(nbytes: int, chunk_bytes: int):
    """(start, stop) of each chunk; the last partial block is a chunk of its own, so the whole
    blocks before it can go direct."""
    for start in range(0, nbytes, chunk_bytes):
        stop = min(start + chunk_bytes, nbytes)
        body = start + (stop - start) // DISK_ALIGN * DISK_ALIGN
        if start < body < stop:
            yield start, body
            yield body, stop
        else:
            yield start, stop


def _preallocate(fd: int, nbytes: int) -> None:
    if nbytes == 0:
        return
    try:
        os.posix_fallocate(fd, 0, nbytes)
    except (OSError, AttributeError) as exc:  # AttributeError: no posix_fallocate on this platform
        if isinstance(exc, OSError) and exc.errno not in _UNSUPPORTED:
            raise
        os.ftruncate(fd, nbytes)  # sparse: NOTE: [Offload files]


def _open_direct(path: Path) -> int | None:
    flag = getattr(os, "O_DIRECT", 0)
    if not flag:
        return None
    try:
        return os.open(path, os.O_RDWR | flag | getattr(os, "O_CLOEXEC", 0))
    except OSError as exc:
        if exc.errno in _UNSUPPORTED:
            return None
        raise


class Worker:
    """One daemon thread running what is submitted, in order, for the rings of disk_states.py and
    disk_acts.py: a read left waiting for a buffer by a step that failed does not hold the process's
    exit (a pool's threads are joined at exit)."""

    def __init__(self, name: str):
        self.jobs: queue.Queue = queue.Queue()
        threading.Thread(target=self._loop, name=name, daemon=True).start()

    def submit(self, fn, *args) -> Future:
        f: Future = Future()
        self.jobs.put((f, fn, args))
        return f

    def _loop(self) -> None:
        while True:
            f, fn, args = self.jobs.get()
            if not f.set_running_or_notify_cancel():
                continue
            try:
                f.set_result(fn(*args))
            except BaseException as exc:  # noqa: BLE001 -- the waiting thread re-raises it
                f.set_exception(exc)
            del f, fn, args  # no reference to the ring left while idle: its file goes with it


def staging_buffer(nbytes: int, pinned: PinnedArena | None) -> torch.Tensor:
    """`nbytes` at a page-aligned address (direct transfers), from `pinned` where given: at their
    size, not the pinned allocator's next power of two (a 32B layer's 0.99 GB of 8-bit states held
    1 GiB, twice, beside the plan's count)."""
    if pinned is None:
        return aligned_empty(nbytes)
    buf = pinned.empty((nbytes + DISK_ALIGN,), torch.uint8)
    skip = -buf.data_ptr() % DISK_ALIGN
    return buf[skip:skip + nbytes]
