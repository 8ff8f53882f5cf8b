"""Page-locked host memory for the runtime's host buffers, at its true size.

NOTE: [Pinned arena]
PyTorch's pinned-memory allocator rounds every request up to a power of two and keeps the rounded
block: a 7B model's 136 MB MLP weight holds 256 MB of page-locked memory, and a plan's masters,
optimizer states and gradient buffers take up to twice the host memory the plan counted. The arena
asks that allocator only for power-of-two chunks (1 GiB, or the next power of two for a larger
tensor), which it hands out unrounded, and cuts the runtime's host tensors out of them first-fit.
Views keep their chunk alive, so nothing is freed early; nothing is ever freed back either: these
buffers live as long as the trainer. Without CUDA the arena hands out plain tensors.
"""

from __future__ import annotations

import torch

from lazytrain.errors import ResourceError
from lazytrain.runtime.carve import Carver, nbytes

CHUNK_BYTES = 1 << 30
_ALIGN = 4096  # page-aligned views: D2H/H2D copies run at full speed from any of them


class PinnedArena:
    def __init__(self, pin: bool, chunk_bytes: int = CHUNK_BYTES):
        self.pin, self.chunk_bytes = pin, chunk_bytes
        self.chunks: list[Carver] = []
        self.used = 0  # bytes handed out

    @property
    def reserved(self) -> int:
        """Page-locked bytes held: the chunks' sizes."""
        return sum(c.buf.numel() for c in self.chunks)

    def empty(self, shape, dtype: torch.dtype) -> torch.Tensor:
        if not self.pin:
            return torch.empty(shape, dtype=dtype)
        n = nbytes(shape, dtype)
        chunk = next((c for c in self.chunks if c.fits(n)), None) or self._grow(n)
        self.used += n
        return chunk.take(shape, dtype)

    def copy_of(self, t: torch.Tensor) -> torch.Tensor:
        return self.empty(t.shape, t.dtype).copy_(t)

    def _grow(self, n: int) -> Carver:
        size = max(self.chunk_bytes, 1 << max(0, n - 1).bit_length())
        try:
            buf = self._allocate(size)
        except RuntimeError as exc:
            raise ResourceError(
                f"could not page-lock {size / 2**30:.2f} GiB more host memory ({self.reserved / 2**30:.2f} GiB "
                f"already held; {exc}). Free host memory, raise the locked-memory limit (ulimit -l), or "
                "compile with a larger --budget so that less is streamed from the host") from None
        self.chunks.append(Carver(buf, _ALIGN))
        return self.chunks[-1]

    def _allocate(self, size: int) -> torch.Tensor:
        return torch.empty(size, dtype=torch.uint8, pin_memory=True)
