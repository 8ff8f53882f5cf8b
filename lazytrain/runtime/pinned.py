"""Page-locked host memory for the runtime's host buffers, at its true size.

NOTE: [Pinned arena]
PyTorch's pinned-memory allocator rounds every request up to a power of two and keeps the rounded
block: a 7B model's 136 MB MLP weight holds 256 MB of page-locked memory. An earlier arena asked it
for 1 GiB chunks and cut tensors out of them first-fit; the chunks' tails still held 6.2 GiB that
no plan counted (of 100 GiB for the 7B bench at 24 GiB with fp32 masters and 32-bit states, whose
host then ran out). So the arena page-locks ordinary host memory of the exact size instead
(`cudaHostRegister`): a buffer of `SMALL` bytes or more gets its own registration; smaller ones
(biases, norms, step counts) share registered chunks of `CHUNK_BYTES`, cut first-fit at page
boundaries. What the arena holds beyond what it hands out is at most one chunk, plus `SMALL` per
chunk and a page per small buffer (under 80 MiB for the 7B bench), which the plan's host reserve
covers (`HOST_RESERVE` in hardware/__init__.py). Views keep their memory alive; the
registrations are released when the arena is collected (views still alive then become ordinary
memory: slower copies, same values). Without CUDA the arena hands out plain tensors.
"""

from __future__ import annotations

import weakref

import torch

from lazytrain.errors import ResourceError
from lazytrain.runtime.carve import Carver, nbytes

CHUNK_BYTES = 64 << 20
SMALL = 1 << 20
_ALIGN = 4096  # page-aligned views: D2H/H2D copies run at full speed from any of them


class PinnedArena:
    def __init__(self, pin: bool, chunk_bytes: int = CHUNK_BYTES, small: int = SMALL):
        self.pin, self.chunk_bytes, self.small = pin, chunk_bytes, small
        self.chunks: list[Carver] = []  # shared by buffers under `small` bytes
        self.buffers: list[torch.Tensor] = []  # every registered buffer, chunks included
        self.used = 0  # bytes handed out
        if pin:
            weakref.finalize(self, _release, self.buffers)

    @property
    def reserved(self) -> int:
        """Page-locked bytes held."""
        return sum(b.numel() for b in self.buffers)

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        if not self.pin:
            return torch.empty(shape, dtype=dtype)
        n = nbytes(shape, dtype)
        self.used += n
        if n >= self.small:
            return self._lock(n)[:n].view(dtype).view(shape)
        chunk = next((c for c in self.chunks if c.fits(n)), None)
        if chunk is None:
            chunk = Carver(self._lock(self.chunk_bytes), _ALIGN)
            self.chunks.append(chunk)
        return chunk.take(shape, dtype)

    def copy_of(self, t: torch.Tensor) -> torch.Tensor:
        return self.empty(t.shape, t.dtype).copy_(t)

    def _lock(self, size: int) -> torch.Tensor:
        try:
            buf = self._allocate(size)
        except RuntimeError as exc:
            raise ResourceError(
                f"could not page-lock {size / 2**30:.2f} GiB more host memory ({self.reserved / 2**30:.2f} GiB "
                f"already held; {exc}). Free host memory, raise the locked-memory limit (ulimit -l), or "
                "compile with a larger --budget so that less is streamed from the host") from None
        self.buffers.append(buf)
        return buf

    def _allocate(self, size: int) -> torch.Tensor:
        """`size` bytes of ordinary host memory, page-locked where they lie."""
        buf = torch.empty(size, dtype=torch.uint8)
        code = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), size, 0)
        if int(getattr(code, "value", code)) != 0:
            raise RuntimeError(f"cudaHostRegister failed: {code}")
        return buf


def _release(buffers: list[torch.Tensor]) -> None:
    """Unregister every buffer (before the list, and so the memory, is dropped)."""
    try:
        unregister = torch.cuda.cudart().cudaHostUnregister
        for buf in buffers:
            unregister(buf.data_ptr())
    except Exception:  # at interpreter exit CUDA may be gone already; the process frees it all
        pass
