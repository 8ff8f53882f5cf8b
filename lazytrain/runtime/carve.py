"""Cutting tensors out of byte buffers: weight and optimizer slots on the device, page-locked
chunks on the host (NOTE: [Slots] in store.py, NOTE: [Pinned arena] in pinned.py)."""

from __future__ import annotations

import torch

from lazytrain.sizes import ALIGN, aligned


def itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


def nbytes(shape, dtype: torch.dtype) -> int:
    return int(torch.Size(shape).numel()) * itemsize(dtype)


class Carver:
    """Cuts aligned tensors out of a byte buffer in order; past its end, falls back to allocating."""

    def __init__(self, buf: torch.Tensor, align: int = ALIGN):
        self.buf, self.offset, self.align = buf, 0, align

    def fits(self, n: int) -> bool:
        return self.offset + n <= self.buf.numel()

    def take(self, shape, dtype: torch.dtype) -> torch.Tensor:
        n = nbytes(shape, dtype)
        if not self.fits(n):
            return torch.empty(shape, dtype=dtype, device=self.buf.device)
        t = self.buf[self.offset:self.offset + n].view(dtype).view(shape)
        self.offset += aligned(n, self.align)
        return t
