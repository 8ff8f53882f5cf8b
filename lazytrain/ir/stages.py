"""The stages pass `blocks` partitions the graph into, and the sizes, times and options per stage
that the solver, `lower` and codegen read: `Stage` (one block, or the prologue or epilogue) and
`Stages` (all of them, in execution order, with what they share).
"""

from __future__ import annotations

from dataclasses import dataclass

from lazytrain.sizes import QUANT_BLOCK

MASTER_BYTES = {"fp32": 4, "bf16": 2}  # master weights per parameter (`--master-weights`)
STATE_BYTES = {"32bit": 8.0, "8bit": 2.0 + 8.0 / QUANT_BLOCK}  # 8-bit: a byte per moment, fp32 absmax per block


@dataclass(frozen=True, slots=True)
class Stage:
    index: int
    name: str  # "prologue", a block path ("model.layers.3") or "epilogue"
    kind: str  # identical stages share a kind letter
    nodes: tuple[str, ...]
    params: tuple[str, ...]  # parameters owned by this stage (not shared)
    placeholders: tuple[str, ...]  # every graph input, buffer and parameter the stage reads
    inputs: tuple[str, ...]  # activations from earlier stages
    outputs: tuple[str, ...]  # activations read by later stages (or the loss)
    grad_outputs: tuple[str, ...]  # outputs that carry gradient
    grad_inputs: tuple[str, ...]  # inputs that carry gradient
    consumers: tuple[int, ...]  # stages reading an output
    producers: tuple[int, ...]  # stages whose outputs this one reads
    param_numel: int
    param_bytes: int
    saved_bytes: int  # activations autograd keeps from forward to backward (NOTE: [Saved activations])
    peak_bytes: int  # transient peak of a forward without autograd (liveness)
    out_bytes: int
    grad_out_bytes: int
    fwd_s: float
    bwd_s: float
    remat_s: float  # its recompute before backward: `fwd_s` less the skipped nodes (NOTE: [Skipped recompute])
    random: bool  # draws random numbers: its recomputes replay its forward's generator state (NOTE: [RNG replay])
    chunks: int = 1  # >1: forward and backward run together in chunks of the batch, at B(s) (pass `chunk`)
    chunk_len: int = 0  # chunked along tokens: positions of one row per chunk (0: along whole rows)
    whole: tuple[str, ...] = ()  # a chunked stage's nodes run once for the whole batch (they read batch inputs alone)
    internal_bytes: int = 0  # largest operator workspace beyond graph values (NOTE: [Operator workspace] in analysis/memory.py)
    largest_numel: int = 0  # its biggest parameter tensor (a bf16 master's fp32 twin, NOTE: [Master weights])
    skips: tuple[str, ...] = ()  # nodes its recompute before backward leaves uncomputed (NOTE: [Skipped recompute])
    # most of its saved values and internal gradients live in its backward, less its weights' gradients
    # (NOTE: [Backward memory], NOTE: [Weight gradients at the backward's peak] in analysis/backward.py)
    backward_bytes: int = 0
    saving_peak_bytes: int = 0  # its forward's peak with autograd keeping what it saves (a saving forward)
    # its recompute and backward together at B(s) where they differ from a saved stage's backward (a
    # compiled body recomputes under another partition, NOTE: [Fused transients]); 0: `backward_bytes`
    remat_backward_bytes: int = 0
    # the share of `fwd_s` and `bwd_s` its element-wise operators take when run eager (NOTE: [Fused
    # stage prices] in passes/fusion.py); its recompute runs them all (skips are linears)
    elementwise_s: float = 0.0
    elementwise_bwd_s: float = 0.0

    @property
    def chain(self) -> bool:
        """Its outputs are read by the next stage alone (a candidate for drop-and-recompute)."""
        return self.consumers == (self.index + 1,)


def fusable(stage) -> bool:
    """Whether a stage's body runs compiled when stage bodies are fused (NOTE: [Fused stages] in
    runtime/fused.py): any but a stage that draws random numbers (its recompute replays the
    forward's generator state). A chunked loss stage's slice body compiles too, priced at its fused
    time and counted at its eager bytes (NOTE: [Compiled loss slices] in runtime/fused.py). One
    predicate for the planner, which prices these stages fused, and the runtime, which compiles
    them: any object with `random` (the IR's `Stage`, the schedule's)."""
    return not stage.random


def compiled_bytes(stage) -> bool:
    """Whether a fused plan counts a `fusable` stage at its compiled body's bytes, fewer than eager's
    (NOTE: [Fused saved activations] in analysis/fused_saved.py): an unchunked one. A chunked loss
    stage is counted at eager's (NOTE: [Compiled loss slices] in runtime/fused.py), so its compile
    may fail to eager. One predicate for the planner, the runtime and the schedule's header."""
    return fusable(stage) and stage.chunks == 1


def eager_reason(stage) -> str:
    """Why a stage that is not `fusable` stays eager."""
    return "draws random numbers"


CLIPPING_MODES = ("exact", "previous-norm", "off")  # NOTE: [Gradient clipping] in runtime/stepping.py


@dataclass(frozen=True, slots=True)
class Stages:
    stages: tuple[Stage, ...]
    shared_params: tuple[str, ...]  # read by several stages: always resident
    shared_numel: int
    shared_bytes: int
    state_bytes: float  # optimizer state per parameter where the GPU steps: 8 (fp32 AdamW) or about 2 (8-bit);
    # host-stepped stages keep fp32 states either way (NOTE: [State precision per stage] in solver/formulation.py)
    fixed_bytes: int  # batch inputs and buffers: resident for the whole step
    requires_grad: frozenset[str]
    master_bytes: int = 4  # master weights per parameter: 4 (fp32) or 2 (bf16, stochastic rounding)
    largest_shared_numel: int = 0  # the biggest shared parameter tensor (a bf16 master's fp32 twin)
    world_size: int = 1  # data-parallel ranks, each running the plan on its own batch
    sharded: bool = False  # with world_size > 1: each rank keeps 1/N of the optimizer state (solver/shards.py)
    weights_sharded: bool = False  # with sharded: each rank's host keeps 1/N of the streamed weights (solver/shards.py)
    disk: bool = False  # the plan may keep host-stepped stages' optimizer states on disk (NOTE: [Disk-resident states] in solver/disk_model.py)
    clipping: str = "exact"  # gradient clipping the plan runs with: "exact", "previous-norm" or "off" (NOTE: [Gradient clipping] in runtime/stepping.py)
    fused: bool = False  # fusable stages run compiled by Inductor, and are priced so (NOTE: [Fused stage prices] in passes/fusion.py)

    def __iter__(self):
        return iter(self.stages)

    def __len__(self):
        return len(self.stages)

    def __getitem__(self, i: int) -> Stage:
        return self.stages[i]

    def grad_maker(self, s: int) -> int:
        """The stage whose backward makes the gradient of stage `s`'s outputs first: the last
        consumer that takes a gradient from them (a consumer reading only outputs without gradient,
        such as the rotary tables every layer reads, makes none). Its buffer `grad:s` lives from that
        backward to `s`'s; counted from the last consumer of any output, every backward window of a
        7B plan at 1 x 65536 stood 448 MiB over the measured one (H200, 2026-12-01)."""
        g = self.stages[s]
        takes = [c for c in g.consumers if set(g.grad_outputs) & set(self.stages[c].grad_inputs)]
        return takes[-1] if takes else g.consumers[-1]

    def weight_bytes(self, s: int) -> int:
        """Every weight stage `s` reads: its own and the shared ones it uses (a tied lm_head)."""
        g = self.stages[s]
        return g.param_bytes + (self.shared_bytes if set(self.shared_params) & set(g.placeholders) else 0)
