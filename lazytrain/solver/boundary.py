"""A stage's outputs (its boundary activations) in tiles: how many, and what their parts on the
device, in host memory and on disk hold.

NOTE: [Boundary tiles]
A stage's offloaded outputs may be split by the tile (`Placement.split`): of `tiles(g)` tiles, the
plan keeps some on the device, sends some to host memory and some on to disk (NOTE: [Activations on
disk] in disk_model.py). The tiles are the outputs' memory order cut in `tiles(g)` equal parts, one
per TILE_BYTES, so for a [batch, tokens, hidden] boundary they are tiles of the sequence; outputs
under one tile are whole, as before. The solver counts the tiles offloaded and those on disk
(the integers `moved` and `dtiles`, `tile_variables`), so a boundary takes each memory by the tile
rather than whole: at 1 x 1,048,576 tokens a 7B layer's input is 7.5 GB in 28 tiles.
What it buys there (Qwen2.5-7B shape, 8-bit states, bf16 masters, `--disk`, the h200 profile,
2-core CPU, 2026-12-05): with whole boundaries the plan dropped 4 of them (61.0 s of recompute a
step) and put 8 on disk, and its search stopped at the 60 s limit at a 1.63 % gap, predicting
1994.0 s. With the shares on disk continuous the same search proved 1933.0 s within 0.76 % in
0.21 s: that relaxation, which tiles make real, was what the search could not close. A whole
boundary's disk decision was the hard one: with tiles kept and offloaded but disk whole, the search
still stopped at its limit (1994.1 s, 1.42 %). With tiles on disk too the plan is 1933.0 s, proven
in 0.27 s, and the whole compile takes 1.70x its capture (bench/README.md, long sequences).
Those plans priced a fused layer's backward without attention's workspace; counted (NOTE:
[Workspace the trace cannot see] in analysis/fused_transients.py), 1M tokens need 149.6 GiB, past
the device, and 983,040 plan at the whole device with 24 boundaries split, solved in 5 s.
On the H200 (2026-12-05, 0248bf9) the 131,072-token plan at 24 GiB ran with 3 boundaries split
(44.60 s a step, 43.04 predicted) and the 262,144 one at 64 GiB with 7 (146.62 s, 139.97).
At runtime (runtime/replay.py) the FREE after the last forward reader copies the device's part of
each output into a buffer of its own (`part:S`) and frees the whole; the RELOAD fills a new whole
from host memory and the disk's ring, and before the first compute that reads it in backward (by
B(cmax), cmax the last reader) a FREE on the compute stream copies the device's part back in and
frees `part:S`. So a split boundary is whole beside its device part at its last forward reader and
from its reload to that compute, and the device part alone between: the step model counts the part
from F(cmax) through B(cmax). Each copy is a device copy of the part (`copy_s`, counted as compute
in series).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from lazytrain.hardware import Hardware
from lazytrain.ir.placement import Outputs, Placement, PlacementError, Split
from lazytrain.ir.stages import Stage, Stages
from lazytrain.sizes import DISK_ALIGN, disk_region_bytes
from lazytrain.solver.footprint import can_put_outputs_on_disk, disk_act_bytes

if TYPE_CHECKING:
    import mip

    from lazytrain.solver.step_model import StepModel

TILE_BYTES = 256 << 20  # one tile of a boundary, as the tiled MLP's and norm's (kernels/tiling.py)
MAX_TILES = 64  # the most tiles a boundary is cut in: the MIP's integer of a stage ranges up to it
SLACK = 8  # bytes per output tensor a kept part may hold beyond its share: each rounds up by an element


def tiles(g: Stage) -> int:
    """How many tiles stage `g`'s outputs are cut in: one per TILE_BYTES, 1 where they are smaller (or
    nobody reads them)."""
    if not g.consumers:
        return 1
    return max(1, min(MAX_TILES, -(-g.out_bytes // TILE_BYTES)))


def kept_tile_bytes(g: Stage) -> float:
    """What one tile on the device costs at most, as the MIP counts it: its share of the outputs, plus
    each tensor's rounding (`kept_bytes` of k tiles is at most k of these)."""
    return g.out_bytes / tiles(g) + SLACK * len(g.outputs) + 1


def disk_tile_bytes(g: Stage) -> float:
    """What one tile on disk costs at most in the offload file and a ring buffer, as the MIP counts
    it: its share, each tensor's rounding, and each tensor's start aligned (`disk_part_bytes` of d
    tiles is at most d of these)."""
    return g.out_bytes / tiles(g) + (SLACK + DISK_ALIGN) * len(g.outputs)


def kept_bytes(g: Stage, split: Split) -> int:
    """The device bytes of stage `g`'s part kept there: each output tensor's first elements."""
    return -(-g.out_bytes * split.device // split.of) + SLACK * len(g.outputs)


def moved_bytes(g: Stage, split: Split | None) -> int:
    """The bytes of stage `g`'s offloaded outputs that leave the device (at most): all of them
    unsplit, else the host's and the disk's tiles."""
    if split is None:
        return g.out_bytes
    return -(-g.out_bytes * (split.host + split.disk) // split.of)


def disk_part_bytes(g: Stage, split: Split | None) -> int:
    """Stage `g`'s outputs on disk, in the offload file and a ring buffer (all of them unsplit)."""
    return disk_region_bytes(g.out_bytes, len(g.outputs), split)


def copy_s(nbytes: float, hw: Hardware) -> float:
    """One device copy of `nbytes` (read and written), at the profile's memory bandwidth."""
    return 2 * nbytes / hw.mem_bandwidth


# ---- the MIP's side (formulation.py, step_model.py, disk_model.py) -------------------------------------
def tile_variables(m: mip.Model, v: dict, stages: Stages) -> None:
    """Adds `moved` and `dtiles` to the variables: where a stage's outputs are more than one tile,
    the tiles offloaded (to host memory and on to disk) and of those the tiles on disk, integers
    bound to its `off` and `adisk`; None where `off` and `adisk` say it all (one tile)."""
    import mip  # here, not above: `lower` reads the sizes (NOTE: [Analysis without the solver] in pipeline.py)
    v["moved"], v["dtiles"] = [], []
    for s, g in enumerate(stages):
        T = tiles(g)
        if T == 1:
            v["moved"].append(None)
            v["dtiles"].append(None)
            continue
        moved = m.add_var(f"moved{s}", var_type=mip.INTEGER, lb=0.0, ub=float(T))
        dtiles = m.add_var(f"dtiles{s}", var_type=mip.INTEGER, lb=0.0, ub=float(T))
        off, adisk = v["off"][s], v["adisk"][s]
        m += moved <= T * off
        m += moved >= off  # offloaded: at least a tile goes
        m += dtiles <= moved
        m += dtiles <= T * adisk  # `adisk`: some on disk
        m += dtiles >= adisk
        if not can_put_outputs_on_disk(stages, s):
            dtiles.ub = 0.0
        v["moved"].append(moved)
        v["dtiles"].append(dtiles)


def split_of(v: dict, s: int, val) -> Split | None:
    """Stage `s`'s split in a solution (`val` of a variable), or None where its outputs go one way."""
    moved, dtiles = v["moved"][s], v["dtiles"][s]
    if moved is None or val(v["off"][s]) < 0.5:
        return None
    T = int(round(moved.ub))
    device, disk = T - int(round(val(moved))), int(round(val(dtiles)))
    if device == 0 and disk in (0, T):
        return None
    return Split(device, disk, T)


def tile_values(v: dict, decisions: list[Placement]) -> dict:
    """`moved` and `dtiles` in `decisions` (a warm start, or a fixed plan's pinned values)."""
    values = {}
    for s, p in enumerate(decisions):
        moved, dtiles, split = v["moved"][s], v["dtiles"][s], p.split
        if moved is None:
            if split is not None:
                raise PlacementError(f"stage {s}'s outputs are one tile: they cannot be split {split!r} (NOTE: "
                                     "[Boundary tiles] in solver/boundary.py)")
            continue
        T = moved.ub
        if split is not None and split.of != T:
            raise PlacementError(f"stage {s}'s outputs are {T:.0f} tiles, not the {split.of} of {split!r}")
        values[moved] = T - split.device if split is not None else T * p.outputs.offloaded
        values[dtiles] = split.disk if split is not None else T * (p.outputs is Outputs.DISK)
    return values


def moved_out(v: dict, s: int, g: Stage):
    """The bytes of stage `s`'s outputs offloaded (to host memory, and on from there to disk): all or
    none, or by the tile."""
    moved = v["moved"][s]
    return g.out_bytes * v["off"][s] if moved is None else (g.out_bytes / tiles(g)) * moved


def outputs_on_disk(v: dict, s: int, g: Stage) -> tuple:
    """Stage `s`'s outputs on disk: what they take in the offload file and a ring buffer, and the
    host memory they leave (NOTE: [Activations on disk] in disk_model.py), whole or by the tile."""
    dtiles = v["dtiles"][s]
    if dtiles is None:
        return disk_act_bytes(g) * v["adisk"][s], g.out_bytes * v["adisk"][s]
    return disk_tile_bytes(g) * dtiles, (g.out_bytes / tiles(g)) * dtiles


def kept_part(model: StepModel, s: int, g: Stage, cmax: int) -> None:
    """The device's part of stage `s`'s split outputs in the step model: made at their last forward
    reader (F(cmax)), copied back after the reload by the first compute that reads them (by
    B(cmax)), each copy compute in series."""
    moved = model.v["moved"][s]
    if moved is None:
        return
    kept = tiles(g) * model.v["off"][s] - moved
    for t in range(model.L.fw(cmax), model.L.bw(cmax) + 1):
        model.mem[t] = model.mem[t] + kept_tile_bytes(g) * kept
    model.recompute = model.recompute + 2 * copy_s(kept_tile_bytes(g), model.hw) * kept
