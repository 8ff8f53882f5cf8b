"""The compiler pipeline: one straight-line function of named stages.

    capture -> causal -> costs -> liveness -> blocks -> chunk -> solve -> lower -> verify -> codegen

`limits` (the decisions a stage can never take, and why) is a side table of the chunked stages:
`solve` closes those decisions, codegen prints the reasons, and `--dump-ir` writes it with `chunk`.

Between stages a hook checks the stage's output (the IR lint after capture, the schedule verifier
after lower), dumps it on request (`--dump-ir DIR`: one file per stage, deterministic) and times it
(`--time-passes`). A failure inside a stage names the stage.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from lazytrain import hardware as hw_profiles
from lazytrain.codegen.render import render
from lazytrain.errors import LazytrainError, PlanError, one_line
from lazytrain.hardware import Hardware
from lazytrain.ir import dump
from lazytrain.ir.capture import capture
from lazytrain.ir.graph import Graph
from lazytrain.ir.lint import lint
from lazytrain.ir.plan import Plan
from lazytrain.passes.causal import causal
from lazytrain.passes.blocks import CLIPPING_MODES, MASTER_BYTES, Stages, blocks
from lazytrain.passes.chunk import LOSS_CHUNK_BYTES, chunk, decide
from lazytrain.passes.costs import costs
from lazytrain.passes.limits import limits, limits_text
from lazytrain.passes.liveness import liveness
from lazytrain.passes.lower import Schedule, lower
from lazytrain.passes.plancache import cached_solve
from lazytrain.passes.solve import smallest_budget
from lazytrain.passes.verify import verify

@dataclass(frozen=True)
class Compiled:
    graph: Graph
    stages: Stages
    plan: Plan
    schedule: Schedule
    memory_trace: tuple[int, ...]
    source_text: str  # the generated schedule.py
    hardware: Hardware


class _Hook:
    def __init__(self, dump_dir: str | Path | None, time_passes: bool):
        self.dir = Path(dump_dir) if dump_dir else None
        if self.dir:
            if self.dir.exists() and not self.dir.is_dir():
                raise PlanError(f"--dump-ir {self.dir} is a file; pass a directory (it is created if missing)")
            try:
                self.dir.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise PlanError(f"--dump-ir {self.dir} cannot be created ({exc.strerror}); pass a directory you "
                                "can write") from None
        self.time_passes = time_passes

    def run(self, name: str, fn, *args, **kwargs):
        start = time.perf_counter()
        try:
            out = fn(*args, **kwargs)
        except LazytrainError:
            raise
        except Exception as exc:
            raise PlanError(f"stage {name} failed: {one_line(exc)}") from exc
        if self.time_passes:
            print(f"[lazytrain] {name:<9} {time.perf_counter() - start:8.3f} s", file=sys.stderr)
            info = getattr(out, "solver", None)
            if info is not None and info.times:  # where the solve's time went
                parts = ", ".join(f"{part} {secs:.3f} s" for part, secs in info.times)
                print(f"[lazytrain]   {info.solver or 'solver'}: {parts}; {info.status}, gap {info.gap:.2%}", file=sys.stderr)
        return out

    def dump(self, index: int, name: str, text: str):
        if self.dir:
            (self.dir / f"{index:02d}-{name}.txt").write_text(text)


def for_states(hw: Hardware, optimizer_states: str) -> Hardware:
    """The profile with the GPU optimizer rate of the chosen state precision; host steps stay
    fp32 (NOTE: [State precision per stage] in passes/solve.py)."""
    if optimizer_states == "8bit":
        return dataclasses.replace(hw, gpu_adamw_params_per_s=hw.gpu_adamw8bit_params_per_s)
    return hw


def analyse(model: torch.nn.Module, batch: dict, hw: Hardware, source: str = "", hook: _Hook | None = None,
            optimizer_states: str = "32bit", master_weights: str = "fp32", loss_chunk_bytes: int = LOSS_CHUNK_BYTES):
    """The stages before the solver: capture, costs, liveness, blocks, chunk."""
    hook = hook or _Hook(None, False)
    graph = hook.run("capture", capture, model, batch, source, hw.device)
    lint(graph)
    hook.dump(0, "capture", dump.text(graph))
    if hook.dir:
        (hook.dir / "00-capture.json").write_text(dump.to_json(graph))
    graph = hook.run("causal", causal, graph)
    lint(graph)
    hook.dump(1, "causal", dump.text(graph))
    node_costs = hook.run("costs", costs, graph, hw)
    hook.dump(2, "costs", dump.text(graph, node_costs))
    last_use = hook.run("liveness", liveness, graph, node_costs)
    hook.dump(3, "liveness", "".join(f"{n} {i}\n" for n, i in last_use.items()))
    stages = hook.run("blocks", blocks, graph, node_costs, last_use, optimizer_states)
    stages = dataclasses.replace(stages, master_bytes=MASTER_BYTES[master_weights])
    hook.dump(4, "blocks", stages_text(stages))
    decision = hook.run("chunk", decide, graph, stages, loss_chunk_bytes)
    chunked = chunk(stages, decision, hw.bytes_per_s)
    hook.dump(5, "chunk", f"# last stage: {decision.reason}\n" + limits_text(chunked, limits(chunked)) + stages_text(chunked))
    return graph, chunked


def compile_model(model: torch.nn.Module, batch: dict, budget: int | str | None = None, hardware: str | Hardware | None = None, *,
                  source: str = "", time_limit: float = 60.0, dump_dir=None, time_passes: bool = False,
                  dtype: torch.dtype | None = None, optimizer_states: str = "32bit", master_weights: str = "fp32",
                  loss_chunk_bytes: int = LOSS_CHUNK_BYTES, world_size: int = 1,
                  shard_state: bool | None = None, clipping: str = "exact", disk: bool = False) -> Compiled:
    """Compile `model(**batch)`'s training step for a GPU budget in bytes (None: the device's memory;
    "min": the smallest feasible one).
    `dtype` casts the (meta) model first: compute runs in it, the runtime keeps fp32 masters.
    `optimizer_states` is "32bit" (torch AdamW) or "8bit" (bitsandbytes' blockwise 8-bit AdamW);
    `master_weights` "fp32" or "bf16" (updated with stochastic rounding).
    `loss_chunk_bytes` is the largest working set of one chunk of a chunked loss stage (0: never chunk).
    `world_size` is the number of data-parallel ranks the schedule runs on; `batch` is one rank's
    batch (NOTE: [Data parallel] in runtime/data_parallel.py). `shard_state` (None: the default,
    sharded for several ranks with 32-bit states) shards master weights and optimizer states over
    the ranks (NOTE: [Sharded state] in runtime/sharding.py); False replicates them on every rank.
    `clipping` is the gradient clipping the schedule runs with (NOTE: [Gradient clipping] in
    runtime/stepping.py): "exact" (the global norm of this step's gradients), "previous-norm" (the
    previous step's) or "off" (bind then refuses `max_grad_norm`). `disk` lets the plan keep host-stepped
    stages' optimizer states on disk where host memory runs short (NOTE: [Disk-resident states] in
    passes/disk_model.py); the runtime keeps them under bind's `offload_dir`."""
    hw = for_states(hardware if isinstance(hardware, Hardware) else hw_profiles.load(hardware), optimizer_states)
    if dtype is not None:
        model = model.to(dtype)
    hook = _Hook(dump_dir, time_passes)
    graph, stages = analyse(model, batch, hw, source, hook, optimizer_states, master_weights, loss_chunk_bytes)
    stages = data_parallel(stages, hw, world_size, shard_state, optimizer_states)
    if clipping not in CLIPPING_MODES:
        raise PlanError(f"clipping {clipping!r} is not a mode; use one of {', '.join(CLIPPING_MODES)}")
    stages = dataclasses.replace(stages, clipping=clipping, disk=bool(disk))
    if budget == "min":  # the smallest feasible budget of these stages: no second capture
        budget = hook.run("minimum", smallest_budget, stages, hw)
    budget = hw.max_budget if budget is None else int(budget)
    plan = hook.run("solve", cached_solve, stages, hw, budget, time_limit)
    hook.dump(6, "solve", plan_text(stages, plan))
    schedule = hook.run("lower", lower, stages, plan, hw)
    trace = hook.run("verify", verify, schedule)
    hook.dump(7, "lower", "".join(f"{e}\n" for e in schedule.events))
    text = hook.run("codegen", render, graph, stages, plan, schedule, batch, hw.name, optimizer_states, master_weights,
                    world_size)
    return Compiled(graph, stages, plan, schedule, trace, text, hw)


def minimum_budget(model: torch.nn.Module, batch: dict, hardware: str | Hardware | None = None,
                   dtype: torch.dtype | None = None, optimizer_states: str = "32bit", master_weights: str = "fp32",
                   loss_chunk_bytes: int = LOSS_CHUNK_BYTES, world_size: int = 1, shard_state: bool | None = None) -> int:
    hw = for_states(hardware if isinstance(hardware, Hardware) else hw_profiles.load(hardware), optimizer_states)
    if dtype is not None:
        model = model.to(dtype)
    _, stages = analyse(model, batch, hw, optimizer_states=optimizer_states, master_weights=master_weights,
                        loss_chunk_bytes=loss_chunk_bytes)
    return smallest_budget(data_parallel(stages, hw, world_size, shard_state, optimizer_states), hw)


def data_parallel(stages: Stages, hw: Hardware, world_size: int, shard_state: bool | None, optimizer_states: str) -> Stages:
    """The stages for `world_size` ranks, their state sharded or replicated (NOTE: [Sharded state] in
    runtime/sharding.py)."""
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise PlanError(f"world_size {world_size!r} is not a number of ranks; pass an integer >= 1 (1: one process)")
    sharded = world_size > 1 and (shard_state if shard_state is not None else optimizer_states == "32bit")
    if sharded and optimizer_states == "8bit":
        raise PlanError(
            "sharded optimizer state (the default with --world-size > 1) keeps 32-bit states only: bitsandbytes' 8-bit "
            "states are quantised in blocks of whole tensors, which a shard would cut. Use --optimizer-states 32bit, "
            "or replicate the state on every rank (--replicate-state; shard_state=False)")
    if sharded and not hw.link_bandwidth > 0:
        raise PlanError(
            f"hardware profile '{hw.name}' has no link_bandwidth (the data-parallel ranks' all-gather bandwidth), which "
            "a plan with sharded state needs: run `lazytrain profile` under `torchrun --nproc-per-node 2` on this "
            "machine, or add \"link_bandwidth\" (bytes/s) to the profile, or replicate the state (--replicate-state)")
    return dataclasses.replace(stages, world_size=world_size, sharded=sharded)


def stages_text(stages: Stages) -> str:
    lines = [f"# {len(stages)} stages; shared parameters: {list(stages.shared_params)}"]
    for s in stages:
        lines.append(
            f"{s.index} {s.name} kind={s.kind} nodes={len(s.nodes)} params={s.param_bytes}B saved={s.saved_bytes}B "
            f"peak={s.peak_bytes}B out={s.out_bytes}B inputs={list(s.inputs)} outputs={list(s.outputs)} "
            f"consumers={list(s.consumers)} fwd={s.fwd_s:.3g}s bwd={s.bwd_s:.3g}s remat={s.remat_s:.3g}s "
            f"skips={list(s.skips)} chunks={s.chunks}"
            + (f" chunk_len={s.chunk_len}" if s.chunk_len else "") + (f" whole={list(s.whole)}" if s.whole else "")
            + (f" internal={s.internal_bytes}B" if s.internal_bytes else "") + f" random={s.random}")
    return "\n".join(lines) + "\n"


def plan_text(stages: Stages, plan: Plan) -> str:
    data = {
        "budget": plan.budget, "peak_bytes": plan.peak_bytes, "host_bytes": plan.host_bytes,
        "decisions": [{"stage": s.name, "placement": repr(p)} for s, p in zip(stages, plan.decisions)],
        "disk_bytes": plan.disk_bytes, "disk_s": plan.disk_s,
        "windows": [list(w[:2]) for w in plan.windows],
    }
    return json.dumps(data, indent=1) + "\n"
