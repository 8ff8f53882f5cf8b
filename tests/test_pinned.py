"""The pinned arena: host buffers cut from power-of-two chunks, never overlapping (NOTE: [Pinned arena])."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from lazytrain.errors import ResourceError
from lazytrain.runtime.pinned import PinnedArena


class _Unpinned(PinnedArena):
    """The arena's carving, with ordinary memory standing in for page-locked chunks."""

    def __init__(self, chunk_bytes):
        super().__init__(pin=True, chunk_bytes=chunk_bytes)

    def _allocate(self, size):
        return torch.empty(size, dtype=torch.uint8)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3000), st.sampled_from([torch.uint8, torch.bfloat16, torch.float32])),
                min_size=1, max_size=30))
def test_buffers_are_disjoint_and_chunks_are_powers_of_two(requests):
    arena = _Unpinned(chunk_bytes=4096)
    tensors = [arena.empty((n,), dtype) for n, dtype in requests]
    for i, t in enumerate(tensors):
        assert t.shape == (requests[i][0],) and t.dtype == requests[i][1]
        t.fill_(i % 100)
    for i, t in enumerate(tensors):  # nothing written later landed in an earlier buffer
        assert bool((t == i % 100).all())
    for chunk in arena.chunks:
        assert chunk.buf.numel() & (chunk.buf.numel() - 1) == 0 and chunk.buf.numel() >= 4096
    assert arena.used == sum(t.numel() * t.element_size() for t in tensors) <= arena.reserved


def test_a_large_buffer_gets_its_own_chunk_and_the_rest_is_reused():
    arena = _Unpinned(chunk_bytes=1 << 20)
    big = arena.empty(((3 << 20) // 4,), torch.float32)  # 3 MiB: a 4 MiB chunk
    assert arena.reserved == 4 << 20
    small = arena.empty((1 << 19,), torch.uint8)  # fits in that chunk's free MiB
    assert arena.reserved == 4 << 20
    assert small.data_ptr() >= big.data_ptr() + (3 << 20)


def test_without_cuda_buffers_are_plain_tensors():
    arena = PinnedArena(pin=False)
    t = arena.empty((3, 4), torch.float32)
    assert t.shape == (3, 4) and not arena.chunks and arena.reserved == 0


def test_a_failed_pin_names_the_amount_and_the_fix():
    class Failing(PinnedArena):
        def _allocate(self, size):
            raise RuntimeError("CUDA error: out of memory")

    with pytest.raises(ResourceError, match=r"1\.00 GiB.*ulimit -l"):
        Failing(pin=True).empty((10,), torch.float32)
