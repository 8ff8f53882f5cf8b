"""The runtime's buffer sizes and alignments that the cost model prices: the solver's footprint
counts the bytes the runtime allocates with these, so both sides import them from here. Pure
Python: the solver imports no torch for them, and the runtime nothing of the solver.
"""

from __future__ import annotations

ALIGN = 256  # where tensors cut out of a byte buffer start (runtime/carve.py: slots, pinned chunks)
DISK_ALIGN = 4096  # the offload file's regions and direct transfers (NOTE: [Offload files] in runtime/disk.py)
# The elements bitsandbytes' blockwise 8-bit optimizers quantise together, each block with its own
# fp32 absmax: `blocksize = 256` in `Optimizer2State.init_state` (bitsandbytes/optim/optimizer.py,
# which sizes the absmax vectors by it) and in `optimizer_update_8bit_blockwise`'s CPU kernel
# (backends/cpu/ops.py), in bitsandbytes 0.50.2 (the CUDA kernel, compiled, takes the absmax
# vectors as sized there). A data-parallel rank's piece of a parameter with 8-bit states is whole
# blocks (NOTE: [Sharded state] in runtime/sharding.py).
QUANT_BLOCK = 256


def aligned(n: int, align: int = ALIGN) -> int:
    return (n + align - 1) // align * align


# NOTE: [Activations on disk] in solver/disk_model.py: one buffer being filled by the D2H copy of an
# offload (or drained by a reload's H2D), one being written (or read), and one to spare, so the disk
# keeps working while a copy waits for its stream
ACT_RING_SIZE = 3


def region_bytes(out_bytes: int, outputs: int) -> int:
    """Bytes a stage's outputs take in a ring buffer and in the file: `out_bytes` of them in
    `outputs` tensors, each starting at a multiple of `DISK_ALIGN` (at most `DISK_ALIGN` - 1 bytes of
    padding before each after the first), rounded up to `DISK_ALIGN` so the whole buffer goes
    direct. The plan counts the same."""
    return aligned(out_bytes + (DISK_ALIGN - 1) * (outputs - 1), DISK_ALIGN) if outputs else 0


def disk_region_bytes(out_bytes: int, outputs: int, split=None) -> int:
    """A stage's outputs on disk (`region_bytes`): all of them, or with a `Split` (NOTE: [Boundary
    tiles] in solver/boundary.py) its disk's share, the last floor(n * disk / of) elements of each
    tensor (at most ceil(out_bytes * disk / of) bytes)."""
    if split is None:
        return region_bytes(out_bytes, outputs)
    return region_bytes(-(-out_bytes * split.disk // split.of), outputs) if split.disk else 0


# NOTE: [Backward steps from disk] in solver/disk_model.py: one buffer being read, one whose states
# are on the GPU for the step, one being written back, so the disk never waits on the ring
STATE_RING_SIZE = 3


# NOTE: [Twin chunks] A bf16 master's fp32 twin, its fp32 gradient and its rounding noise take 12
# bytes a parameter while its step runs. Made for a whole tensor, that is 2.8 GB for Qwen2.5-1.5B's
# tied embedding and 9.3 GB for the 14B's lm_head, allocated after backward when memory is fullest:
# on the H200 a 1.5B plan at 40 GiB spent 116 ms in the embedding's step (11 ms with room), the
# allocator at its cap freeing its cache and mapping pages again. So a large tensor steps in pieces
# of `TWIN_CHUNK` elements: AdamW and the 8-bit update are elementwise, and a piece's 8-bit states
# are whole quantisation blocks, so the pieces compute what one step of the whole tensor would; the
# rounding noise of an element depends on its index alone (NOTE: [Host rounding noise] in
# runtime/optim.py).
TWIN_CHUNK = 1 << 24
