"""The choices a compile is made with, as one frozen value from the command line (or `compile_model`)
to the stages that read them.

    CompileOptions(budget="min", optimizer_states="8bit", world_size=2, shard_state=False)

Each field is checked once, when the value is built: a compile never starts with a choice no stage
implements. What the choices mean for the stages (state and master bytes, ranks, sharding, clipping,
the disk tier) is filled into `Stages` by `apply_options`; the budget is resolved against the
hardware and the stages by `pipeline.resolve_budget`.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from lazytrain.errors import PlanError
from lazytrain.hardware import Hardware
from lazytrain.ir.stages import CLIPPING_MODES, MASTER_BYTES, STATE_BYTES, Stages
from lazytrain.passes.chunk import LOSS_CHUNK_BYTES

BUDGET_WORDS = ("min", "max")  # the smallest feasible budget; the device's memory (as None)
# --fuse-stages: auto follows the hardware profile (compile) or, on a GPU, the schedule's FUSED (train)
FUSE_STAGES = {"auto": None, "on": True, "off": False}


@dataclass(frozen=True, slots=True)
class CompileOptions:
    """What a compile is asked for.

    `budget` is the GPU memory budget: None or "max" (the device's memory less what no plan can use),
    "min" (the smallest feasible one) or bytes. `time_limit` bounds the solver, in seconds.
    `dtype` casts the (meta) model first: compute runs in it, the runtime keeps fp32 masters.
    `optimizer_states` is "32bit" (torch AdamW) or "8bit" (bitsandbytes' blockwise 8-bit AdamW);
    `master_weights` "fp32" or "bf16" (updated with stochastic rounding).
    `loss_chunk_bytes` is the largest working set of one chunk of a chunked loss stage (0: never chunk).
    `tile_bytes` computes each gated MLP and RMSNorm in tiles of tokens whose widest intermediate takes
    at most that many bytes, recomputed in backward (NOTE: [Tiled MLP] in kernels/tiled_mlp.py,
    [Tiled RMSNorm] in kernels/tiled_norm.py; 0: never tile); None (the default) tiles only where
    no untiled plan fits, or where it lowers the smallest budget asked for (NOTE: [Tiles where
    nothing else fits] in pipeline.py).
    `world_size` is the number of data-parallel ranks the schedule runs on; the batch compiled is one
    rank's (NOTE: [Data parallel] in runtime/data_parallel.py). `shard_state` (None: the default,
    sharded for several ranks) shards master weights and optimizer states over
    the ranks (NOTE: [Sharded state] in runtime/sharding.py); False replicates them on every rank.
    `shard_weights` (None: the default, sharded wherever the state is) also keeps 1/N of every
    streamed block's compute-dtype weights in each rank's host memory, all-gathered at every
    prefetch (NOTE: [Sharded host weights] in runtime/host_weights.py); False keeps them whole.
    `clipping` is the gradient clipping the schedule runs with (NOTE: [Gradient clipping] in
    runtime/stepping.py): "exact" (the global norm of this step's gradients), "previous-norm" (the
    previous step's) or "off" (bind then refuses `max_grad_norm`). `disk` lets the plan keep host-stepped
    stages' optimizer states on disk where host memory runs short (NOTE: [Disk-resident states] in
    solver/disk_model.py); the runtime keeps them under bind's `offload_dir`.
    `fuse_stages` prices the stages whose bodies the runtime compiles with Inductor at their fused
    time, and records `FUSED = True` in the schedule (NOTE: [Fused stage prices] in passes/fusion.py):
    None (the default) for a CUDA hardware profile and not for the CPU's, True or False to choose."""

    budget: int | str | None = None
    time_limit: float = 60.0
    dtype: torch.dtype | None = None
    optimizer_states: str = "32bit"
    master_weights: str = "fp32"
    loss_chunk_bytes: int = LOSS_CHUNK_BYTES
    tile_bytes: int | None = None
    world_size: int = 1
    shard_state: bool | None = None
    shard_weights: bool | None = None
    clipping: str = "exact"
    disk: bool = False
    fuse_stages: bool | None = None

    def __post_init__(self):
        b = self.budget
        if not (b is None or b in BUDGET_WORDS or (_whole(b) and b >= 0)):
            raise PlanError(f"budget {b!r} is not a GPU budget; pass bytes (an integer >= 0), 'min' (the smallest "
                            "feasible) or 'max' (the device's memory; None means the same)")
        t = self.time_limit
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not t > 0 or math.isnan(t):
            raise PlanError(f"time_limit {t!r} is not a solver time limit; pass a number of seconds > 0")
        if self.dtype is not None and not (isinstance(self.dtype, torch.dtype) and self.dtype.is_floating_point):
            raise PlanError(f"dtype {self.dtype!r} is not a compute dtype; pass a floating torch dtype such as "
                            "torch.bfloat16, or None (the model's)")
        if self.optimizer_states not in STATE_BYTES:
            raise PlanError(f"optimizer_states {self.optimizer_states!r} is not a state precision; use one of "
                            f"{', '.join(STATE_BYTES)}")
        if self.master_weights not in MASTER_BYTES:
            raise PlanError(f"master_weights {self.master_weights!r} is not a master precision; use one of "
                            f"{', '.join(MASTER_BYTES)}")
        if not (_whole(self.loss_chunk_bytes) and self.loss_chunk_bytes >= 0):
            raise PlanError(f"loss_chunk_bytes {self.loss_chunk_bytes!r} is not a working set; pass bytes (an "
                            "integer >= 0; 0 never chunks)")
        if not (self.tile_bytes is None or (_whole(self.tile_bytes) and self.tile_bytes >= 0)):
            raise PlanError(f"tile_bytes {self.tile_bytes!r} is not a working set; pass bytes (an "
                            "integer >= 0; 0 never tiles), or None (tiles where nothing else fits)")
        if not (_whole(self.world_size) and self.world_size >= 1):
            raise PlanError(f"world_size {self.world_size!r} is not a number of ranks; pass an integer >= 1 (1: one "
                            "process)")
        if not isinstance(self.shard_state, (bool, type(None))):
            raise PlanError(f"shard_state {self.shard_state!r} is not a choice; pass True (shard over the ranks), "
                            "False (replicate on every rank) or None (sharded for several ranks)")
        if not isinstance(self.shard_weights, (bool, type(None))):
            raise PlanError(f"shard_weights {self.shard_weights!r} is not a choice; pass True (each rank's host keeps "
                            "1/N of the streamed weights), False (every rank keeps them whole) or None (sharded "
                            "wherever the state is)")
        if self.shard_weights and self.shard_state is False:  # one rank has nothing to shard: as shard_state
            raise PlanError("shard_weights=True shards the host weights in the cut of the ranks' sharded state, but "
                            "shard_state=False (--replicate-state) replicates the state: leave shard_weights unset, or "
                            "shard the state (shard_state=None or True)")
        if self.clipping not in CLIPPING_MODES:
            raise PlanError(f"clipping {self.clipping!r} is not a mode; use one of {', '.join(CLIPPING_MODES)}")
        if not isinstance(self.disk, bool):
            raise PlanError(f"disk {self.disk!r} is not a choice; pass True (the plan may use the disk tier) or False")
        if not isinstance(self.fuse_stages, (bool, type(None))):
            raise PlanError(f"fuse_stages {self.fuse_stages!r} is not a choice; pass True (stage bodies compiled by "
                            "Inductor), False (eager) or None (compiled for a CUDA hardware profile)")

    def fused(self, hw: Hardware) -> bool:
        """Whether the plan is for fused stage bodies: as asked, else on a CUDA hardware profile (where
        `lazytrain train --fuse-stages auto` compiles them)."""
        return self.fuse_stages if self.fuse_stages is not None else hw.device == "cuda"

    @property
    def sharded(self) -> bool:
        """Each rank keeps 1/N of the master weights and optimizer states (NOTE: [Sharded state] in
        runtime/sharding.py): by default with several ranks, 32-bit or 8-bit states alike."""
        return self.world_size > 1 and (self.shard_state if self.shard_state is not None else True)

    @property
    def weights_sharded(self) -> bool:
        """Each rank's host keeps 1/N of the streamed weights (NOTE: [Sharded host weights] in
        runtime/host_weights.py): by default wherever the state is sharded."""
        return self.sharded and (self.shard_weights if self.shard_weights is not None else True)


def _whole(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def from_settings(options: CompileOptions | None, budget, settings: dict) -> CompileOptions:
    """The options of a call that takes either `options=` or a budget and settings as keywords,
    never both."""
    if options is None:
        return CompileOptions(budget=budget, **settings)
    given = sorted(settings) + (["budget"] if budget is not None else [])
    if given:
        raise PlanError(f"{', '.join(given)} given beside options=; pass every setting inside the CompileOptions "
                        "(dataclasses.replace(options, ...)), or only as keywords")
    return options


def apply_options(stages: Stages, options: CompileOptions, hw: Hardware) -> Stages:
    """The stages with the fields the options decide: state and master bytes per parameter, the
    ranks and whether their state is sharded, the clipping mode, the disk tier and fused bodies."""
    if options.sharded and not hw.link_bandwidth > 0:
        raise PlanError(
            f"hardware profile '{hw.name}' has no link_bandwidth (the data-parallel ranks' all-gather bandwidth), which "
            "a plan with sharded state needs: run `lazytrain profile` under `torchrun --nproc-per-node 2` on this "
            "machine, or add \"link_bandwidth\" (bytes/s) to the profile, or replicate the state (--replicate-state)")
    return dataclasses.replace(stages, state_bytes=STATE_BYTES[options.optimizer_states],
                               master_bytes=MASTER_BYTES[options.master_weights], world_size=options.world_size,
                               sharded=options.sharded, weights_sharded=options.weights_sharded, clipping=options.clipping,
                               disk=options.disk, fused=options.fused(hw))


def check_budget(options: CompileOptions, hw: Hardware) -> None:
    """A budget in bytes from the command line (`lazytrain compile`, `lazytrain train`) is refused
    above what a plan can have on `hw` (`Hardware.check_budget`): a plan within it would be an OOM
    on the device. `compile_model` itself takes any (a budget of 1 << 40 plans without a cap)."""
    if isinstance(options.budget, int):
        hw.check_budget(options.budget)
