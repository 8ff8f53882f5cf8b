"""The compiler pipeline: one straight-line function of named stages.

    capture -> causal -> gqa -> costs -> liveness -> blocks -> chunk -> fusion -> solve -> lower -> verify -> codegen

Where the compile chooses the tile size (NOTE: [Tiles where nothing else fits]), `retile` rewrites
the captured graph for each size searched, and costs through solve run once a size.

`limits` (the decisions a stage can never take, and why) is a side table of the chunked stages:
`solve` closes those decisions, codegen prints the reasons, and `--dump-ir` writes it with `chunk`.

Between stages a hook checks the stage's output (the IR lint after capture, the schedule verifier
after lower), dumps it on request (`--dump-ir DIR`: one file per stage, deterministic) and times it
(`--time-passes`). A failure inside a stage names the stage.

NOTE: [Analysis without the solver]
`analyse` (capture through fusion) needs no solver: `lazytrain profile` prices a layer's element-wise
share with it on a GPU machine, which may have torch and transformers but not python-mip. So the
solver is imported where a plan is solved, not with this module.

The choices a compile is made with travel as one CompileOptions (lazytrain/options.py), checked when
it is built; the stages get theirs after blocks, and the budget is resolved once, before solve.
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
from lazytrain import progress
from lazytrain.codegen.render import render
from lazytrain.errors import InfeasibleBudget, LazytrainError, PlanError, one_line
from lazytrain.hardware import FUSED_HOST_RESERVE, Hardware
from lazytrain.ir import dump
from lazytrain.ir.capture import capture
from lazytrain.ir.graph import Graph
from lazytrain.ir.lint import lint
from lazytrain.ir.plan import Plan
from lazytrain.ir.schedule import Schedule
from lazytrain.ir.stages import Stages
from lazytrain.kernels.tiled import tileable, tiled
from lazytrain.options import CompileOptions, apply_options, from_settings
from lazytrain.passes.blocks import blocks
from lazytrain.passes.causal import causal
from lazytrain.passes.chunk import chunk, decide
from lazytrain.passes.costs import costs
from lazytrain.passes.fusion import fusion
from lazytrain.passes.gqa import gqa
from lazytrain.passes.limits import limits, limits_text
from lazytrain.passes.liveness import liveness
from lazytrain.passes.lower import lower
from lazytrain.passes.retile import GATED_MLP, RMS_NORM, TILE_SIZES, retile
from lazytrain.passes.verify import verify
from lazytrain.solver.reserve import with_reserve
from lazytrain.units import format_size

@dataclass(frozen=True)
class Compiled:
    graph: Graph
    stages: Stages
    plan: Plan
    schedule: Schedule
    memory_trace: tuple[int, ...]
    source_text: str  # the generated schedule.py
    hardware: Hardware
    options: CompileOptions  # as given: `plan.budget` is the budget they resolved to


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
            with progress.stage(name):  # NOTE: [Compile progress] in progress.py
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


def analyse(model: torch.nn.Module, batch: dict, hw: Hardware, source: str = "", hook: _Hook | None = None, *,
            options: CompileOptions | None = None, **settings):
    """The stages before the solver: capture, costs, liveness, blocks, chunk, fusion; the model cast to the
    options' dtype first, the stages given the fields the options decide (`apply_options`)."""
    options = from_settings(options, None, settings)
    hook = hook or _Hook(None, False)
    graph = _captured(model, batch, hw, source, hook, options)
    return graph, _stages(graph, hw, hook, options)


def _captured(model: torch.nn.Module, batch: dict, hw: Hardware, source: str, hook: _Hook,
              options: CompileOptions) -> Graph:
    """Capture (in the options' dtype and tiles), then passes `causal` and `gqa`."""
    if options.dtype is not None:
        model = model.to(options.dtype)
    with tiled(model, options.tile_bytes):  # NOTE: [Tiled MLP], [Tiled RMSNorm] in kernels/
        graph = hook.run("capture", capture, model, batch, source, hw.device)
    lint(graph)
    hook.dump(0, "capture", dump.text(graph))
    if hook.dir:
        (hook.dir / "00-capture.json").write_text(dump.to_json(graph))
    return rewritten(graph, hook)


# The passes that rewrite the captured graph, in order: a schedule's FINGERPRINT is of the graph
# they leave, which resuming on another number of ranks captures again (train/loop.py)
REWRITES = (("causal", causal), ("gqa", gqa))


def rewritten(graph: Graph, hook: _Hook | None = None) -> Graph:
    """The captured `graph` after the passes that rewrite it (`REWRITES`): the graph a schedule of it
    is fingerprinted by."""
    hook = hook or _Hook(None, False)
    for name, rewrite in REWRITES:
        graph = hook.run(name, rewrite, graph)
        lint(graph)
        hook.dump(1, name, dump.text(graph))
    return graph


def _stages(graph: Graph, hw: Hardware, hook: _Hook, options: CompileOptions) -> Stages:
    """The passes from `costs` to `fusion`: the stages the solver plans."""
    node_costs = hook.run("costs", costs, graph, hw)
    hook.dump(2, "costs", dump.text(graph, node_costs))
    last_use = hook.run("liveness", liveness, graph, node_costs)
    hook.dump(3, "liveness", "".join(f"{n} {i}\n" for n, i in last_use.items()))
    stages = apply_options(hook.run("blocks", blocks, graph, node_costs, last_use), options, hw)
    hook.dump(4, "blocks", stages_text(stages))
    decision = hook.run("chunk", decide, graph, stages, options.loss_chunk_bytes)
    chunked = chunk(stages, decision, hw.bytes_per_s)
    # NOTE: [Fused stage prices] in passes/fusion.py: after chunk, which decides what cannot fuse
    chunked = hook.run("fusion", fusion, chunked, hw.fused_elementwise_factor, graph)
    hook.dump(5, "chunk", f"# last stage: {decision.reason}\n" + limits_text(chunked, limits(chunked)) + stages_text(chunked))
    return chunked


def resolve_budget(options: CompileOptions, stages: Stages, hw: Hardware, hook: _Hook | None = None) -> int:
    """The budget in bytes the plan is solved for: the device's memory less what no plan can use
    for None and "max" (`Hardware.max_budget`), the smallest feasible budget of these stages for
    "min" (no second capture), and bytes as given."""
    match options.budget:
        case None | "max":
            return hw.max_budget
        case "min":
            from lazytrain.solver.solve import smallest_budget  # NOTE: [Analysis without the solver]

            return (hook or _Hook(None, False)).run("minimum", smallest_budget, stages, hw)
        case budget:
            return budget


def _planning(hw: Hardware, graph: Graph, stages: Stages) -> Hardware:
    """The machine these stages are planned for, by a compile and by `minimum_budget` alike: the host
    less Inductor's share with fused stage bodies (NOTE: [Compiler's host memory] in
    hardware/__init__.py), and room under the budget for the step's largest allocation (NOTE: [Room
    for the largest block] in solver/reserve.py)."""
    return with_reserve(hw.planning(stages.fused), graph, stages)


def _hardware(hardware: str | Hardware | None) -> Hardware:
    return hardware if isinstance(hardware, Hardware) else hw_profiles.load(hardware)


# NOTE: [Tiles where nothing else fits]
# Tiling a row's token-wise work (NOTE: [Tiled MLP], [Tiled RMSNorm] in kernels/) lowers what a
# layer holds at long sequences (the Qwen2.5-7B shape at 1 x 131072: 47.3 GiB at least untiled,
# 19.0 GiB tiled, bench/README.md) and costs time: backward recomputes two of the MLP's three
# products and the norms. So by default (`tile_bytes` None) a compile tiles only where it must: it
# plans untiled, and where no untiled plan fits the budget it captures again in tiles of
# AUTO_TILE_BYTES and plans each size of TILE_SIZES from that capture, keeping the fastest plan
# that fits (NOTE: [Tile sizes] in passes/retile.py); for `--budget min` it plans both ways and
# keeps the smallest budget. A model with nothing to tile compiles once. The second capture happens
# on a refusal only, and not on one tiles cannot change (the training state alone past the budget:
# NOTE: [State past the host] in solver/refusal.py); a `tile_bytes` given is planned as given.
AUTO_TILE_BYTES = 256 << 20


def _tile_choices(model: torch.nn.Module, options: CompileOptions) -> list[CompileOptions]:
    """The options to plan with, in order (NOTE: [Tiles where nothing else fits])."""
    if options.tile_bytes is not None or not tileable(model):  # None tiles nothing (`tiled`)
        return [options]
    return [dataclasses.replace(options, tile_bytes=0), dataclasses.replace(options, tile_bytes=AUTO_TILE_BYTES)]


def _sized(graph: Graph, options: CompileOptions, search: bool) -> list[tuple[Graph, CompileOptions]]:
    """The graphs (and options) of each tile size searched: the captured one alone, or, with
    `search`, one per size of TILE_SIZES that changes some tile count (NOTE: [Tile sizes])."""
    if not search:
        return [(graph, options)]
    out, seen = [], set()
    for size in TILE_SIZES:
        g = graph if size == options.tile_bytes else retile(graph, size)
        counts = tuple(n.args for n in g.nodes if n.target in (GATED_MLP, RMS_NORM))
        if counts not in seen:
            seen.add(counts)
            out.append((g, dataclasses.replace(options, tile_bytes=size)))
    return out


def compile_model(model: torch.nn.Module, batch: dict, budget: int | str | None = None, hardware: str | Hardware | None = None, *,
                  options: CompileOptions | None = None, source: str = "", dump_dir=None, time_passes: bool = False,
                  **settings) -> Compiled:
    """Compile `model(**batch)`'s training step, for `options` (lazytrain/options.py) or for a `budget`
    and settings given as keywords (`time_limit=`, `optimizer_states=`, `world_size=`, ...), which
    make one CompileOptions. `hardware` is a profile's name or file, or a Hardware (None: h200);
    `batch` is one rank's batch. Tiles where nothing else fits unless `tile_bytes` says (NOTE:
    [Tiles where nothing else fits])."""
    options = from_settings(options, budget, settings)
    hw = _hardware(hardware)
    choices = _tile_choices(model, options)
    if len(choices) == 1:
        return _compile(model, batch, hw, choices[0], source, dump_dir, time_passes)
    untiled, tiled_ = choices
    if options.budget == "min":
        plans = [_compile(model, batch, hw, o, source, dump_dir, time_passes, search=bool(o.tile_bytes))
                 for o in choices]
        return min(plans, key=lambda c: c.plan.budget)
    try:
        return _compile(model, batch, hw, untiled, source, dump_dir, time_passes)
    except InfeasibleBudget as refused:
        if refused.any_tiles:  # NOTE: [State past the host] in solver/refusal.py
            raise
        if time_passes:
            print(f"[lazytrain] no untiled plan fits; planning in tiles of "
                  f"{', '.join(format_size(s) for s in TILE_SIZES)}", file=sys.stderr)
        try:
            return _compile(model, batch, hw, tiled_, source, dump_dir, time_passes, search=True)
        except InfeasibleBudget as also:
            raise _amended(also, f" (with its MLPs and norms in tiles, --tile-bytes; untiled it needs "
                                 f"{format_size(refused.smallest_feasible, round_up=True)})",
                           min(also.smallest_feasible, refused.smallest_feasible)) from None


def _amended(refusal: InfeasibleBudget, clause: str, smallest: int | None = None) -> InfeasibleBudget:
    """`refusal` with `clause` added to its last sentence (its closing full stop kept last)."""
    text = str(refusal)
    stop = "." if text.endswith(".") else ""
    return InfeasibleBudget(text.removesuffix(".") + clause + stop,
                            refusal.smallest_feasible if smallest is None else smallest, refusal.any_tiles)


def _compile(model: torch.nn.Module, batch: dict, hw: Hardware, options: CompileOptions, source: str, dump_dir,
             time_passes: bool, search: bool = False) -> Compiled:
    """The plan of `options`, or with `search` the fastest of the tile sizes' plans that fit (the
    smallest budget's for "min"); where none fits, the refusal of the size that needs least."""
    from lazytrain.solver.plancache import cached_solve  # NOTE: [Analysis without the solver]

    hook = _Hook(dump_dir, time_passes)
    captured = _captured(model, batch, hw, source, hook, options)
    measure = (lambda p: p.budget) if options.budget == "min" else (lambda p: p.step_s)
    best, refusal = None, None
    for graph, sized in _sized(captured, options, search):
        stages = _stages(graph, hw, hook, sized)
        planning = _planning(hw, graph, stages)
        try:
            budget = resolve_budget(sized, stages, planning, hook)
            plan = hook.run("solve", cached_solve, stages, planning, budget, sized.time_limit)
        except InfeasibleBudget as exc:
            if search:  # NOTE: [Tile sizes] in passes/retile.py
                exc = _amended(exc, f" (in tiles of {format_size(sized.tile_bytes)})")
            if planning.host_memory_bytes < hw.host_memory_bytes:  # NOTE: [Compiler's host memory]
                exc = _amended(exc, f"; with fused stage bodies the plan leaves Inductor {format_size(FUSED_HOST_RESERVE)} "
                                    "of the host (--fuse-stages off plans without)")
            refusal = exc if refusal is None or exc.smallest_feasible < refusal.smallest_feasible else refusal
            continue
        if best is None or measure(plan) < measure(best[2]):
            best = (graph, stages, plan, sized, planning)
    if best is None:
        raise refusal
    graph, stages, plan, sized, planning = best
    hook.dump(6, "solve", plan_text(stages, plan))
    schedule = hook.run("lower", lower, stages, plan, planning)
    trace = hook.run("verify", verify, schedule)
    hook.dump(7, "lower", "".join(f"{e}\n" for e in schedule.events))
    text = hook.run("codegen", render, graph, stages, plan, schedule, batch, hw.name, sized.optimizer_states,
                    sized.master_weights, sized.world_size, fused_factor=hw.fused_elementwise_factor)
    return Compiled(graph, stages, plan, schedule, trace, text, hw, sized)


def minimum_budget(model: torch.nn.Module, batch: dict, hardware: str | Hardware | None = None, *,
                   options: CompileOptions | None = None, **settings) -> int:
    """The smallest feasible budget of `model(**batch)` compiled with these options (their budget
    aside), in bytes: where the tiles are the compile's to choose, over every size searched. A plan
    fits it; the least any plan needs may be up to the least-memory solve's gap below it
    (`LEAST_GAP` in solver/solve.py, 1 %)."""
    from lazytrain.solver.solve import smallest_budget  # NOTE: [Analysis without the solver]

    options = from_settings(options, None, settings)
    hw = _hardware(hardware)
    hook = _Hook(None, False)
    choices = _tile_choices(model, options)
    budgets = []
    for o in choices:
        captured = _captured(model, batch, hw, "", hook, o)
        for g, sized in _sized(captured, o, search=len(choices) > 1 and bool(o.tile_bytes)):
            stages = _stages(g, hw, hook, sized)
            budgets.append(smallest_budget(stages, _planning(hw, g, stages)))
    return min(budgets)


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
