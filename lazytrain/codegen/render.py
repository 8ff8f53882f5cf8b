"""Codegen: a compiled step -> `schedule.py`, a plain Python module a person can read top to bottom.

jinja2 renders the skeleton (templates/schedule.py.j2); `printers.py` writes the event lines; each
stage becomes a function of ATen calls printed from the IR, one node per line.
"""

from __future__ import annotations

from pathlib import Path

import jinja2

from lazytrain.analysis.chunk_rules import LOSS_OP
from lazytrain.codegen.printers import print_event
from lazytrain.ir.dump import format_arg, format_call, format_value
from lazytrain.ir.graph import Graph, OpKind, Sym, TensorSpec
from lazytrain.ir.placement import Outputs, Placement
from lazytrain.ir.plan import Plan
from lazytrain.ir.schedule import Schedule
from lazytrain.ir.stages import Stages, compiled_bytes, eager_reason, fusable
from lazytrain.passes.chunk import MEAN, SUM, loss_args
from lazytrain.passes.limits import limits
from lazytrain.runtime.schedule import FORMAT_VERSION, checksum
from lazytrain.solver.footprint import prefetches_from_master
from lazytrain.summary import CLIPPING_TEXT, chunk_text, decision_line, memory_name, ranges
from lazytrain.units import format_size

_ENV = jinja2.Environment(
    loader=jinja2.FileSystemLoader(Path(__file__).parent / "templates"),
    trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True, undefined=jinja2.StrictUndefined,
)


def sums_loss(graph: Graph, stage) -> bool:
    """Whether the stage's function takes `loss_sum` (then its loss is the sum over targets, returned
    with the number of targets counted): a chunked stage (NOTE: [Chunked loss] in runtime/chunked.py),
    and a stage whose loss is the mean of an unweighted cross-entropy over class indices, whose data-
    parallel ranks weight their gradients by those counts (NOTE: [Data parallel] in
    runtime/data_parallel.py)."""
    if stage.chunks > 1:
        return True
    if stage.outputs != (graph.output,) or graph[graph.output].target != LOSS_OP:
        return False
    a = loss_args(graph[graph.output])
    target = graph[a.target.value].value if isinstance(a.target, Sym) and a.target.kind == "ref" else None
    return (a.weight is None and a.reduction == MEAN and a.label_smoothing == 0.0
            and isinstance(target, TensorSpec) and not target.is_float)


def stage_function(graph: Graph, stage) -> str:
    """The stage as a function of ATen calls. A chunked stage also takes `loss_sum` (as does a stage
    with a mean cross-entropy loss: `sums_loss`), and reads its whole part's results after its inputs
    (NOTE: [Chunked loss] in runtime/chunked.py)."""
    chunked = stage.chunks > 1
    summed = sums_loss(graph, stage)
    whole = set(stage.whole)
    results = whole_outputs(graph, stage)
    args = ", ".join(("device",) + stage.placeholders + stage.inputs + results + (("loss_sum=False",) if summed else ())
                     + (("remat=False",) if stage.skips else ()))
    doc = f"{stage.name} (kind {stage.kind})"
    if chunked:
        doc += f"; runs in {chunk_text(stage)}"
    if summed:
        doc += "; with loss_sum, returns (sum of the losses, targets counted)"
    if stage.skips:
        doc += ("; with remat (its recompute before backward), the linears whose values backward never reads "
                "return zeros (NOTE: [Skipped recompute])")
    lines = [f"def stage_{stage.index}({args}):", f'    """{doc}"""']
    body = tuple(n for n in stage.nodes if n not in whole)
    keep = set(stage.outputs) | {graph.output} | ({loss_args(graph[graph.output]).target.value} if summed else set())
    lines += _node_lines(graph, stage, body, keep, summed)
    if summed:
        a = loss_args(graph[graph.output])
        lines.append("    if loss_sum:  # the mean's numerator and denominator: chunks and ranks add them up exactly")
        lines.append(f"        return ({graph.output}, ({format_arg(a.target)} != {a.ignore_index!r}).sum())")
    outs = "".join(f"{o}, " for o in stage.outputs)
    lines.append(f"    return ({outs.rstrip(' ')})")
    if stage.whole:
        args = ", ".join(("device",) + stage.placeholders)
        lines = [f"def stage_{stage.index}_whole({args}):",
                 f'    """{stage.name}: its nodes reading batch inputs alone, run once for the whole batch before its chunks"""',
                 *_node_lines(graph, stage, stage.whole, set(results), False),
                 f"    return ({''.join(f'{o}, ' for o in results).rstrip(' ')})", "", "", *lines]
    return "\n".join(lines)


def whole_outputs(graph: Graph, stage) -> tuple[str, ...]:
    """A chunked stage's whole-part results that its chunks read."""
    whole = set(stage.whole)
    read = {r for n in stage.nodes if n not in whole for r in graph[n].inputs()}
    return tuple(n for n in stage.whole if n in read)


def _node_lines(graph: Graph, stage, names: tuple[str, ...], keep: set[str], summed: bool) -> list[str]:
    lines = []
    dead_after = _dead_after(graph, names, keep)
    for name in names:
        node = graph[name]
        if node.op is OpKind.GETITEM:
            src, idx = node.args
            expr = f"{format_arg(src)}[{idx}]"
        elif summed and name == graph.output:
            a = loss_args(node)
            parts = [format_arg(a.input), format_arg(a.target), format_arg(a.weight), f"{SUM} if loss_sum else {MEAN}",
                     format_arg(a.ignore_index), format_arg(a.label_smoothing)]
            expr = f"{node.target}({', '.join(parts)})"
        else:
            call = format_call(node)
            expr = call if call.startswith("aten.") else f"torch.ops.{call}"
        if name in stage.skips:  # NOTE: [Skipped recompute] in analysis/remat.py
            expr = f"{format_call(node, 'grad_only_linear')} if remat else {expr}"
        lines.append(f"    {name} = {expr}  # {format_value(node.value)}")
        if dead_after.get(name):
            lines.append(f"    del {', '.join(dead_after[name])}")
    return lines


def _dead_after(graph: Graph, names: tuple[str, ...], keep: set[str]) -> dict[str, list[str]]:
    """node -> the function's own values last read by it. Deleting them there keeps a forward's
    memory at the liveness peak the plan counts (`peak_bytes`): without autograd, a local stays
    alive until the function returns. Values in `keep` (outputs, what a chunked stage's epilogue
    reads) are kept."""
    local = set(names)
    last: dict[str, str] = {}
    for name in names:
        for src in graph[name].inputs():
            if src in local:
                last[src] = name
    dead: dict[str, list[str]] = {}
    for src, reader in last.items():
        if src not in keep:
            dead.setdefault(reader, []).append(src)
    return {k: sorted(v, key=names.index) for k, v in dead.items()}


def _chunk_fields(graph: Graph, stage) -> str:
    """The runtime's fields of a chunked stage cut along tokens, or with a whole part."""
    text = ""
    if stage.chunk_len:
        rows, seq = next(n.spec.shape[:2] for n in graph.of(OpKind.INPUT))  # pass `chunk`: every batch input's
        text += f", chunk_len={stage.chunk_len}, tokens={(rows, seq)!r}"
    if stage.whole:
        text += f", whole_fn=stage_{stage.index}_whole, whole_outputs={whole_outputs(graph, stage)!r}"
    return text


def _ranks_text(world_size: int, sharded: bool, weights: bool = False) -> str:
    if world_size == 1:
        return "one process"
    if sharded:
        return (f"data parallel: each rank runs this plan on its own batch of the shape below; gradients are "
                f"reduce-scattered over the {world_size} ranks, each steps its 1/{world_size} of the optimizer state and "
                "the updated weights are all-gathered (REDUCE and GATHER events, in the predictions)"
                + ("; each rank's host keeps its 1/{} of the streamed weights, all-gathered at every prefetch".format(world_size)
                   if weights else ""))
    return (f"data parallel: each rank runs this plan on its own batch of the shape below; gradients are averaged "
            f"over the {world_size} ranks, and the predictions leave that communication out")


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.3f} ms"


def _stage_line(graph: Graph, s, p: Placement, lim, from_master: bool, optimizer_states: str) -> str:
    """The schedule's `Stage(...)` entry for stage `s` under its placement `p`."""
    return (
        f"Stage({s.index}, {s.name!r}, stage_{s.index}, placeholders={s.placeholders!r}, params={s.params!r}, "
        f"inputs={s.inputs!r}, outputs={s.outputs!r}, grad_inputs={s.grad_inputs!r}, "
        f"grad_outputs={s.grad_outputs!r}, placement={p!r}, "
        f"kind={s.kind!r}, param_bytes={s.param_bytes}, param_numel={s.param_numel}, "
        f"chunks={s.chunks}" + _chunk_fields(graph, s) + (", loss_sum=True" if sums_loss(graph, s) else "")
        + (", from_master=True" if from_master else "")
        + (f", out_bytes={s.out_bytes}" if p.outputs is Outputs.DISK else "")
        + (f", skips={s.skips!r}" if s.skips else "")
        + (f", states={p.states(optimizer_states)!r}" if p.states(optimizer_states) != "32bit" else "")
        + (", random=True" if s.random else "") + (f", limits={lim.notes()!r}" if lim.notes() else "") + "),")


def fused_lines(stages: Stages, factor: float) -> list[str]:
    """The header's account of the fused regions (NOTE: [Fused stages] in runtime/fused.py): which
    stages run compiled by Inductor and which stay eager, and why."""
    if not stages.fused:
        return ["no: every stage runs its ATen calls below, eager (the plan priced them so)"]
    compiled = [s for s in stages if fusable(s)]
    price = (f"their element-wise time priced at {factor:.2f} of eager" if factor < 1
             else "priced as eager (the hardware profile has no fused rate)")
    lines = ["yes: on a GPU the stage bodies below run compiled by Inductor (torch.compile), one compile per "
             "kind; the ATen calls are what they compute"]
    if compiled:
        kinds = ", ".join(dict.fromkeys(s.kind for s in compiled))
        lines.append(f"  compiled: stage{'s' if len(compiled) > 1 else ''} {ranges([s.index for s in compiled])} "
                     f"(kind{'s' if ',' in kinds else ''} {kinds}), {price}")
    for s in stages:
        if not fusable(s):
            lines.append(f"  eager:    stage {s.index} {s.name} ({eager_reason(s)})")
        elif not compiled_bytes(s):  # NOTE: [Compiled loss slices] in runtime/fused.py
            lines.append(f"  slices:   stage {s.index} {s.name} compiles the body each slice runs; "
                         "its memory counted as eager's")
    return lines


def render(graph: Graph, stages: Stages, plan: Plan, schedule: Schedule, batch: dict, hardware: str,
           optimizer_states: str = "32bit", master_weights: str = "fp32", world_size: int = 1,
           fused_factor: float = 1.0) -> str:
    buffers = {b.name: b for b in schedule.buffers}
    names = [s.name for s in stages]
    closed = limits(stages)
    decision_lines = []
    from_master = [prefetches_from_master(stages, s, d) for s, d in enumerate(plan.decisions)]
    for s, p, lim in zip(stages, plan.decisions, closed):
        decision_lines.append(decision_line(s, p, graph.device, optimizer_states, from_master[s.index]))
        decision_lines += [f"{'':>4}{note}" for note in lim.notes()]
    placeholders = [
        (n.name, n.op.value, n.target, tuple(n.spec.shape), n.spec.dtype)
        for n in graph.of(OpKind.PARAM, OpKind.BUFFER, OpKind.INPUT)
    ]
    stage_lines = [_stage_line(graph, s, p, lim, from_master[s.index], optimizer_states)
                   for s, p, lim in zip(stages, plan.decisions, closed)]
    buffer_lines = [f"Buffer({b.name!r}, {b.pool!r}, {b.bytes}, persistent={b.persistent}),  # {format_size(b.bytes)}"
                    for b in schedule.buffers]
    info = plan.solver
    # No solve time here: a schedule is a deterministic function of its inputs (golden files).
    solver_text = f"{info.status}, gap {info.gap:.2%}" + (f" ({info.message})" if info.message else "")
    text = _ENV.get_template("schedule.py.j2").render(
        source=graph.source, fingerprint=graph.fingerprint(), budget=plan.budget, budget_text=format_size(plan.budget, round_up=True),
        batch_text=", ".join(f"{k}={v.dtype}{list(v.shape)}".replace("torch.", "") for k, v in batch.items()),
        batch=[(k, tuple(v.shape), str(v.dtype).removeprefix("torch.")) for k, v in batch.items()],
        hardware=hardware, device=graph.device, memory_name=memory_name(graph.device), optimizer_states=optimizer_states, master_weights=master_weights, state_bytes=stages.state_bytes, peak=plan.peak_bytes, peak_text=format_size(plan.peak_bytes), step_s=plan.step_s,
        step_text=_ms(plan.step_s), compute_text=_ms(plan.compute_s), recompute_text=_ms(plan.recompute_s),
        exposed_text=_ms(plan.exposed_s), optimizer_text=_ms(plan.optimizer_s), solver_text=solver_text,
        decision_lines=decision_lines, format_version=FORMAT_VERSION, loss=graph.output,
        placeholders=placeholders, shared=repr(stages.shared_params),
        functions=[stage_function(graph, s) for s in stages], stage_lines=stage_lines, buffer_lines=buffer_lines,
        predicted=repr({"compute_s": plan.compute_s, "recompute_s": plan.recompute_s, "exposed_s": plan.exposed_s,
                        "optimizer_s": plan.optimizer_s, "host_bytes": plan.host_bytes,
                        "disk_bytes": plan.disk_bytes, "disk_s": plan.disk_s}),
        solver=repr({"status": info.status, "gap": info.gap, "message": info.message}),
        windows=[repr((label, nbytes, secs)) for label, nbytes, secs in plan.windows],
        event_lines=[print_event(e, buffers, names) for e in schedule.events], checksum="@CHECKSUM@",
        world_size=world_size, ranks_text=_ranks_text(world_size, stages.sharded and world_size > 1, stages.weights_sharded),
        sharded=stages.sharded and world_size > 1, sharded_weights=stages.weights_sharded and world_size > 1,
        clipping=stages.clipping, clipping_text=CLIPPING_TEXT[stages.clipping],
        fused=stages.fused, fused_lines=fused_lines(stages, fused_factor),
    )
    return text.replace('CHECKSUM = "@CHECKSUM@"', f'CHECKSUM = "{checksum(text)}"')
