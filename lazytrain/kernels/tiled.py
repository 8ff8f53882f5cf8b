"""`tiled`: while it is held, a model's token-wise work computes in tiles of tokens (what a compile
captures with CompileOptions.tile_bytes): its gated MLPs (NOTE: [Tiled MLP]) and its RMSNorms
(NOTE: [Tiled RMSNorm])."""

import contextlib

import torch

from lazytrain.kernels.tiled_mlp import restore_mlps, swap_mlps
from lazytrain.kernels.tiled_norm import restore_norms, swap_norms
from lazytrain.kernels.tiling import tiles_for


@contextlib.contextmanager
def tiled(model: torch.nn.Module, tile_bytes: int):
    """Yields {"mlp": gated MLPs swapped, "norm": RMSNorms swapped}, each computing in the fewest
    tiles whose widest intermediate takes at most `tile_bytes` (0: nothing changes, both 0)."""
    if not tile_bytes:
        yield {"mlp": 0, "norm": 0}
        return

    def tiles_of(x: torch.Tensor, width: int, itemsize: int) -> int:
        return tiles_for(x.numel() // x.shape[-1], width, itemsize, tile_bytes)

    try:
        yield {"mlp": swap_mlps(model, tiles_of), "norm": swap_norms(model, tiles_of)}
    finally:
        restore_mlps(model)
        restore_norms(model)


def tileable(model: torch.nn.Module) -> int:
    """How many of `model`'s modules `tiled` would make compute in tiles (none is left changed)."""
    with tiled(model, 1) as counts:
        return sum(counts.values())
