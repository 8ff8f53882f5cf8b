"""Pass `retile`: the tiled operators of a captured graph, set to another tile size.

Needs: a `Graph` captured with tiles (CompileOptions.tile_bytes, NOTE: [Tiled MLP], [Tiled
RMSNorm] in kernels/). Guarantees: the same graph, each `lazytrain::gated_mlp` and
`lazytrain::rms_norm` with the tile count capture would have given it for `tile_bytes` (`tiles_for`
of its rows, as `kernels.tiled.tiled` counts them), nothing else changed.

    gated_mlp = lazytrain.gated_mlp.default(x, gate, up, down, 'silu', 19)     # 256 MiB tiles
      -> gated_mlp = lazytrain.gated_mlp.default(x, gate, up, down, 'silu', 5)  # 1 GiB tiles

NOTE: [Tile sizes]
A tile's size trades time against memory: smaller tiles hold less (a 7B MLP's intermediates at
131,072 tokens: 6.6 GiB at the peak in 256 MiB tiles, 12.1 GiB in 1 GiB ones) and their products
run slower (NOTE: [Matmuls of a tile] in hardware/__init__.py: 4.4 % more MLP time in 256 MiB tiles
than in 1 GiB ones on the H200, 20 % in 64 MiB ones). Where no untiled plan fits and the size is
the compile's to choose (NOTE: [Tiles where nothing else fits] in pipeline.py), it plans each of
`TILE_SIZES` from the one tiled capture, rewritten here, and keeps the fastest plan that fits:
the tile size is a decision of the plan like the others, searched over these sizes. A rewrite, not
a capture per size: the operators take their tile count as an argument, so the graphs differ in
that argument alone.
"""

from __future__ import annotations

import dataclasses

from lazytrain.ir.graph import Graph, TensorSpec
from lazytrain.kernels.tiling import tiles_for
from lazytrain.passes.costs import GATED_MLP, RMS_NORM

# bytes of a tile's widest intermediate: the capture's size (pipeline.AUTO_TILE_BYTES) first, which
# a later size replaces only where it plans strictly better
TILE_SIZES = (256 << 20, 1 << 30, 64 << 20)


def retile(graph: Graph, tile_bytes: int) -> Graph:
    nodes = []
    for n in graph.nodes:
        if n.target in (GATED_MLP, RMS_NORM):
            x = graph[n.args[0].value].spec
            at = 5 if n.target == GATED_MLP else 4
            tiles = _tiles(x, graph, n, tile_bytes)
            n = dataclasses.replace(n, args=n.args[:at] + (tiles,) + n.args[at + 1:])
        nodes.append(n)
    return dataclasses.replace(graph, nodes=tuple(nodes))


def _tiles(x: TensorSpec, graph: Graph, n, tile_bytes: int) -> int:
    """The tile count capture gives the operator (`kernels.tiled.tiled`): the MLP's intermediate in
    x's dtype, the norm's rows in float32."""
    rows = x.numel // max(1, x.shape[-1])
    if n.target == GATED_MLP:
        return tiles_for(rows, graph[n.args[1].value].spec.shape[0], x.nbytes // max(1, x.numel), tile_bytes)
    return tiles_for(rows, x.shape[-1], 4, tile_bytes)
