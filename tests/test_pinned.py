"""The pinned arena: host buffers page-locked at their true size, never overlapping (NOTE: [Pinned arena])."""

import pytest
import torch
from hypothesis import given, settings, strategies as st

from lazytrain.errors import ResourceError
from lazytrain.runtime.pinned import PinnedArena


class _Unpinned(PinnedArena):
    """The arena's carving, with ordinary memory standing in for page-locked chunks."""

    def __init__(self, chunk_bytes, small=None):
        super().__init__(pin=True, chunk_bytes=chunk_bytes, small=small or chunk_bytes // 4)

    def _allocate(self, size):
        return torch.empty(size, dtype=torch.uint8)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 3000), st.sampled_from([torch.uint8, torch.bfloat16, torch.float32])),
                min_size=1, max_size=30))
def test_buffers_are_disjoint_and_held_at_their_true_size(requests):
    arena = _Unpinned(chunk_bytes=4096)
    tensors = [arena.empty((n,), dtype) for n, dtype in requests]
    for i, t in enumerate(tensors):
        assert t.shape == (requests[i][0],) and t.dtype == requests[i][1]
        t.fill_(i % 100)
    for i, t in enumerate(tensors):  # nothing written later landed in an earlier buffer
        assert bool((t == i % 100).all())
    assert arena.used == sum(t.numel() * t.element_size() for t in tensors) <= arena.reserved
    # large buffers are held exactly; small ones waste at most a chunk, `small` per chunk and a page each
    large = sum(t.numel() * t.element_size() for t in tensors if t.numel() * t.element_size() >= arena.small)
    n_small = sum(t.numel() * t.element_size() < arena.small for t in tensors)
    assert arena.reserved - arena.used <= arena.chunk_bytes + len(arena.chunks) * arena.small + n_small * 4096
    assert sum(b.numel() for b in arena.buffers if all(b is not c.buf for c in arena.chunks)) == large


def test_the_7b_layer_tensors_are_held_without_rounding():
    """The sizes that left 6.2 GiB in chunk tails: a 7B layer's fp32 and bf16 weights, many times."""
    arena = _Unpinned(chunk_bytes=64 << 20, small=1 << 20)
    arena._allocate = lambda size: torch.empty(size, dtype=torch.uint8, device="meta")
    shapes = [(18944, 3584)] * 3 + [(3584, 3584)] * 2 + [(512, 3584)] * 2 + [(3584,)] * 3 + [(512,)] * 2
    for _ in range(28):
        for dtype in (torch.float32, torch.bfloat16, torch.bfloat16, torch.float32, torch.float32):
            for shape in shapes:
                arena.empty(shape, dtype)
    assert arena.reserved - arena.used < 2 * arena.chunk_bytes


def test_without_cuda_buffers_are_plain_tensors():
    arena = PinnedArena(pin=False)
    t = arena.empty((3, 4), torch.float32)
    assert t.shape == (3, 4) and not arena.chunks and arena.reserved == 0


def test_a_failed_pin_names_the_amount_and_the_fix():
    class Failing(PinnedArena):
        def _allocate(self, size):
            raise RuntimeError("CUDA error: out of memory")

    with pytest.raises(ResourceError, match=r"0\.06 GiB.*ulimit -l"):
        Failing(pin=True).empty((10,), torch.float32)
